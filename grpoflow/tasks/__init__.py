"""Tasks shipped inside the package, loadable by name with no network: `--dataset echo`,
`--dataset gsm8k`, `--dataset relay` (multi-turn, with `grpoflow.tasks.relay:RelayEnvironment`);
and tasks of other libraries named `LIBRARY:NAME` (`reasoning_gym:basic_arithmetic`,
grpoflow.tasks.library)."""

from __future__ import annotations

from collections.abc import Callable

from grpoflow.tasks import echo, gsm8k, reasoning_gym_tasks, relay
from grpoflow.tasks.library import LibrarySpec, parse_spec

TASKS: dict[str, Callable[[str], list[dict]]] = {
    "echo": echo.load_rows,
    "gsm8k": gsm8k.load_rows,
    "relay": relay.load_rows,
}
"""Task name -> function(split) returning the task's rows."""

LIBRARIES: dict[str, Callable[[LibrarySpec, str, int], list[dict]]] = {
    reasoning_gym_tasks.LIBRARY: reasoning_gym_tasks.load_rows,
}
"""Library name -> function(spec, split, seed) returning the rows a spec names."""


def library_rows(spec: str, split: str, seed: int) -> list[dict] | None:
    """The rows of a `LIBRARY:NAME` spec; None when `spec` names no library's task."""
    parsed = parse_spec(spec, tuple(LIBRARIES))
    return None if parsed is None else LIBRARIES[parsed.library](parsed, split, seed)
