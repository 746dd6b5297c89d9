"""Tasks shipped inside the package, loadable by name with no network: `--dataset echo`,
`--dataset gsm8k`, `--dataset relay` (multi-turn, with `grpoflow.tasks.relay:RelayEnvironment`);
and tasks and environments of other libraries named `LIBRARY:NAME`
(`reasoning_gym:basic_arithmetic`, `verifiers:TASKSET_ID`, `openenv:pkg.module:Environment`,
grpoflow.tasks.library)."""

from __future__ import annotations

from collections.abc import Callable

from grpoflow.tasks import echo, gsm8k, openenv_env, reasoning_gym_tasks, relay, verifiers_env
from grpoflow.tasks.library import LibrarySpec, parse_spec

TASKS: dict[str, Callable[[str], list[dict]]] = {
    "echo": echo.load_rows,
    "gsm8k": gsm8k.load_rows,
    "relay": relay.load_rows,
}
"""Task name -> function(split) returning the task's rows."""

LIBRARIES: dict[str, Callable[[LibrarySpec, str, int], list[dict]]] = {
    reasoning_gym_tasks.LIBRARY: reasoning_gym_tasks.load_rows,
    verifiers_env.LIBRARY: verifiers_env.load_rows,
    openenv_env.LIBRARY: openenv_env.load_rows,
}
"""Library name -> function(spec, split, seed) returning the rows a spec names."""

ENVIRONMENTS: dict[str, Callable[[LibrarySpec], type]] = {
    verifiers_env.LIBRARY: verifiers_env.environment_class,
    openenv_env.LIBRARY: openenv_env.environment_class,
}
"""Library name -> function(spec) returning the episode class of the environment a spec names."""


def library_rows(spec: str, split: str, seed: int) -> list[dict] | None:
    """The rows of a `LIBRARY:NAME` spec; None when `spec` names no library's task."""
    parsed = parse_spec(spec, tuple(LIBRARIES))
    return None if parsed is None else LIBRARIES[parsed.library](parsed, split, seed)


def library_environment(spec: str) -> type:
    """The episode class (reset, respond, get_reward) of a `LIBRARY:NAME` environment spec."""
    parsed = parse_spec(spec, tuple(ENVIRONMENTS))
    if parsed is None:
        raise ValueError(
            f"environment {spec!r} names no library's environment: write "
            f"{' or '.join(f'{library}:NAME' for library in ENVIRONMENTS)}"
        )
    return ENVIRONMENTS[parsed.library](parsed)
