"""What compiling the update's layers cost earlier runs of the same shapes on this machine.

A compiled run's first step pays for Dynamo's trace, AOTAutograd and Inductor. With an earlier
run's artifacts of the same shapes in Inductor's caches (`compiling`) it pays less: on an H200 the
standard 0.5B update's first compiled step took 13.1 s more than the next ones with empty caches
and 2.7 s in a second run (benchmarks/results/2026-11-28-compile-20-steps-{cold,warm}-*), most of
it Dynamo tracing a layer anew, which no cache holds. The file `costs_path` keeps,
per shape (a key the caller makes of what the compiled graphs depend on), what the first run paid
and what the latest run that found the artifacts paid; the choice of `torch_compile` counts what
this run will pay (`expected_seconds`) instead of the empty-cache figure, and a compiled run
records what it paid once its second step ends (`CompileCostRecorder`). A file that cannot be read
or written only costs the figure, with one log line.

A training run's layers compile beside training (`background_compile`): its first update runs them
uncompiled while the compiler shares the interpreter. The recorded figure, the first update less
the second, then also holds what any run's first step pays (2.2 s for the uncompiled run in the
call of 2026-11-28-compile-20-steps-beside-*, 1.9 s for the compiled one), so it overstates what
compiling costs, and the choice errs towards leaving compile off.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

logger = logging.getLogger("grpoflow.policy.compile_costs")

CACHED_SHARE = 0.2
"""What a run of shapes compiled before pays, as a share of what the first run paid, until such a
run has been measured: on an H200, 2.73 of 13.12 s for the standard 0.5B update, 2.56 of 14.6 s
for it under LoRA, 3.44 of 15.23 s for the 7B shape under LoRA (2026-11-28-compile-*-{cold,warm}
and the runs' compile_seconds.json)."""


def grpoflow_cache_dir(environ: MutableMapping[str, str] = os.environ) -> Path:
    """grpoflow's cache directory: $XDG_CACHE_HOME/grpoflow (~/.cache by default)."""
    return Path(environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "grpoflow"


def costs_path(environ: MutableMapping[str, str] = os.environ) -> Path:
    """compile_seconds.json in grpoflow's cache directory."""
    return grpoflow_cache_dir(environ) / "compile_seconds.json"


def _read(path: Path) -> dict[str, dict[str, float]]:
    try:
        costs = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        logger.warning("compile costs in %s unreadable (%s): using the empty-cache figures", path, error)
        return {}
    return costs if isinstance(costs, dict) else {}


def expected_seconds(shape: str, environ: MutableMapping[str, str] = os.environ) -> float | None:
    """What compiling `shape` will cost this run: what the latest run that found its artifacts
    paid, else CACHED_SHARE of what the first run paid; None when no run of it was measured."""
    entry = _read(costs_path(environ)).get(shape)
    if not isinstance(entry, dict) or "first" not in entry:
        return None
    cached = entry.get("cached")
    return float(cached) if cached is not None else float(entry["first"]) * CACHED_SHARE


def record_seconds(shape: str, seconds: float, environ: MutableMapping[str, str] = os.environ) -> None:
    """Keep what compiling `shape` cost this run: the first run's cost, or, once one is kept,
    the cost with its artifacts cached."""
    path = costs_path(environ)
    costs = _read(path)
    entry = costs.get(shape)
    known = isinstance(entry, dict) and "first" in entry
    costs[shape] = {**entry, "cached": round(seconds, 2)} if known else {"first": round(seconds, 2)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(costs, indent=1, sort_keys=True) + "\n")
        temporary.replace(path)
    except OSError as error:
        logger.warning("compile cost not kept in %s (%s)", path, error)


class CompileCostRecorder:
    """A step observer (`GRPOTrainer`'s `observers`) that records what compiling cost a run: its
    first step's update time less its second's, once the second has ended."""

    def __init__(self, shape: str, environ: MutableMapping[str, str] = os.environ) -> None:
        self.shape, self.environ = shape, environ
        self.updates: list[float] = []

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if len(self.updates) >= 2 or "time/update" not in metrics:
            return
        self.updates.append(metrics["time/update"])
        if len(self.updates) == 2:
            seconds = max(self.updates[0] - self.updates[1], 0.0)
            record_seconds(self.shape, seconds, self.environ)
            logger.info(
                "compiling the layers cost about %.0f s (kept for later runs of these shapes)", seconds
            )
