"""Tasks shipped inside the package, loadable by name with no network: `--dataset echo`, `--dataset gsm8k`."""

from __future__ import annotations

from collections.abc import Callable

from grpoflow.tasks import echo, gsm8k

TASKS: dict[str, Callable[[str], list[dict]]] = {"echo": echo.load_rows, "gsm8k": gsm8k.load_rows}
"""Task name -> function(split) returning the task's rows."""
