"""Tasks shipped inside the package, loadable by name with no network: `--dataset echo`,
`--dataset gsm8k`, `--dataset relay` (multi-turn, with `grpoflow.tasks.relay:RelayEnvironment`)."""

from __future__ import annotations

from collections.abc import Callable

from grpoflow.tasks import echo, gsm8k, relay

TASKS: dict[str, Callable[[str], list[dict]]] = {
    "echo": echo.load_rows,
    "gsm8k": gsm8k.load_rows,
    "relay": relay.load_rows,
}
"""Task name -> function(split) returning the task's rows."""
