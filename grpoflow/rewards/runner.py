"""Scoring a batch with several reward functions at once, robust to the functions' failures.

All functions of a batch start together and each gets `timeout` seconds:

* async functions (`async def`, or an async `__call__`) are awaited concurrently on the runner's
  own event loop, which lives in a background thread for the runner's lifetime (so clients such
  as HTTP sessions bound to a loop can be reused across batches);
* sync functions each run in a daemon thread of their own. A thread cannot be killed, so one that
  overstays its timeout is left to finish (a daemon thread neither blocks later batches nor the
  interpreter's exit) and the function is not started again while it runs: at most one stray
  thread per function. If the function can be pickled and the pool has workers, it moves to the
  process pool for the rest of the run, where a timeout kills its work;
* functions with `cpu_heavy = True` run in a process pool ('forkserver' context by default, so
  it is safe next to torch's threads), created on first use and reused. They must be picklable:
  module-level functions or instances of module-level classes (plugin files count, they are
  re-imported in the workers). When one overstays its timeout the pool's workers are terminated
  and a new pool is made on the next batch, since a running pool task cannot be cancelled.
  Extra arguments that can't be pickled (TRL's `log_metric` callback, say) are not sent to them.

A function that raises is retried sample by sample so only the bad samples lose their value; a
timed-out function loses the whole batch. Values come back as NaN where missing, never as an
exception: `RewardBatch.errors` and the "grpoflow.rewards" logger say what went wrong.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import multiprocessing
import pickle
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import torch

from grpoflow.rewards.evaluate import NAN, Outcome, RewardCall, evaluate, evaluate_async
from grpoflow.rewards.params import RewardConfig
from grpoflow.rewards.plugins import import_file, load_plugins, plugin_files, resolve_reward
from grpoflow.threads import in_daemon_thread

logger = logging.getLogger("grpoflow.rewards")

MAX_LOGGED_ERRORS = 3
"""Errors logged one by one per batch; the rest are counted."""
LOOP_GRACE_SECONDS = 10.0
"""How long past `timeout` to wait for the event loop before deciding an async function blocks it."""


@dataclass(frozen=True, slots=True)
class RewardError:
    """Something a reward function got wrong on a batch."""

    name: str
    """The function's name in the runner."""
    index: int | None
    """The sample concerned; None when the whole batch is."""
    message: str
    """What happened and, where known, how to fix it."""

    def __str__(self) -> str:
        where = "whole batch" if self.index is None else f"sample {self.index}"
        return f"reward {self.name!r} ({where}) {self.message}"


@dataclass(slots=True)
class RewardBatch:
    """The rewards of one batch (`grpoflow.algo.combine_rewards(values, weights)` sums them)."""

    values: torch.Tensor
    """(batch, num_funcs) float32; NaN where a function gave no value."""
    names: list[str]
    """Function names, one per column of `values`."""
    weights: torch.Tensor
    """(num_funcs,) float32 weights."""
    errors: list[RewardError]
    """Everything that went wrong, in function order."""
    seconds_per_func: dict[str, float]
    """Wall-clock seconds each function took (its timeout when it timed out)."""

    @property
    def training_values(self) -> torch.Tensor:
        """`values` with a failed sample missing altogether: every value of a sample on which any
        function failed (raised; or the function timed out or answered the batch wrongly) is NaN,
        so its other rewards do not score it alone. A None from a function that does not apply to
        a sample (TRL's convention) is no failure: the sample's other rewards still count."""
        values = self.values.clone()
        if any(error.index is None for error in self.errors):
            values[:] = float("nan")
        else:
            values[sorted({error.index for error in self.errors})] = float("nan")
        return values

    @property
    def failed_everywhere(self) -> frozenset[str]:
        """Functions that failed on every sample of the batch (an empty batch has none)."""
        size = len(self.values)
        failed: dict[str, set[int | None]] = {}
        for error in self.errors:
            failed.setdefault(error.name, set()).add(error.index)
        return frozenset(
            name for name, indices in failed.items() if size and (None in indices or len(indices) == size)
        )


class RewardRunner:
    """Runs reward functions over batches (see the module docstring for how they run).

    Args:
        funcs: `(name, function)` pairs; names must be unique.
        weights: one weight per function; None means all 1.0.
        timeout: seconds each function may take per batch (RewardConfig.reward_timeout).
        num_workers: process-pool size for CPU-heavy functions; 0 runs them in threads.
        mp_context: multiprocessing start method of the pool: 'forkserver' or 'spawn'.
    """

    def __init__(
        self,
        funcs: Sequence[tuple[str, Callable[..., Any]]],
        weights: Sequence[float] | None = None,
        timeout: float = 60.0,
        num_workers: int = 2,
        mp_context: str = "forkserver",
    ) -> None:
        self.names = [name for name, _ in funcs]
        self.funcs = [fn for _, fn in funcs]
        _check_funcs(self.names, self.funcs)
        if weights is None:
            weights = [1.0] * len(self.funcs)
        if len(weights) != len(self.funcs):
            raise ValueError(
                f"Got {len(weights)} reward weights for {len(self.funcs)} reward functions "
                f"({', '.join(self.names)}); give one weight per function or none."
            )
        if timeout <= 0:
            raise ValueError(f"The reward timeout must be > 0 seconds, got {timeout}")
        if num_workers < 0:
            raise ValueError(
                f"num_workers must be >= 0 (0 runs CPU-heavy rewards in threads), got {num_workers}"
            )
        if mp_context not in multiprocessing.get_all_start_methods() or mp_context == "fork":
            raise ValueError(
                f"mp_context must be 'forkserver' or 'spawn' ('fork' is unsafe next to torch's threads), got {mp_context!r}"
            )
        self.weights = torch.tensor([float(w) for w in weights], dtype=torch.float32)
        self.timeout = float(timeout)
        self.num_workers = num_workers
        self.mp_context = mp_context
        self.kinds = [_kind(fn, num_workers) for fn in self.funcs]
        self._loop: _LoopThread | None = None
        self._process_pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pool_needs_reset = False
        self._unsent_arguments: set[str] = set()
        self._overrunning: dict[int, concurrent.futures.Future] = {}
        """Threads of sync functions still running past their timeout, by function index."""

    @classmethod
    def from_config(
        cls,
        config: RewardConfig,
        *,
        device: Any = None,
        extra: Sequence[tuple[str, Callable[..., Any]]] = (),
    ) -> RewardRunner:
        """The runner of a rewards section: its plugins loaded, its `reward_funcs` resolved (names,
        import paths, or callables given in Python; see `resolve_reward`), then its reward models
        on `device`, then the `extra` (name, function) pairs (an environment's reward), weight 1."""
        load_plugins(config.external_plugins)
        funcs = [(reward_name(spec), resolve_reward(spec, config)) for spec in config.reward_funcs]
        models = config.reward_models
        if models:
            from grpoflow.rewards.model import RewardModel

            names = (
                ["reward_model"] if len(models) == 1 else [path.rstrip("/").split("/")[-1] for path in models]
            )
            funcs += [(name, RewardModel(path, device=device)) for name, path in zip(names, models)]
        funcs += list(extra)
        if not funcs:
            raise ValueError(
                "a run needs a reward: set reward_funcs or reward_model, or give the environment a get_reward method"
            )
        weights = None if config.reward_weights is None else [*config.reward_weights, *[1.0] * len(extra)]
        return cls(funcs, weights, timeout=config.reward_timeout, num_workers=config.reward_num_workers)

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: dict[str, Sequence[Any]] | None = None,
        **extra: Any,
    ) -> RewardBatch:
        """Score a batch with every function; never raises because of a reward function.

        `columns` are the dataset columns (one value per completion); `extra` keyword arguments
        (e.g. `trainer_state`) reach the functions unchanged.
        """
        call = _make_call(prompts, completions, completion_ids, {**(columns or {}), **extra})
        if len(call) == 0:
            return self._batch([Outcome([], []) for _ in self.funcs], [0.0] * len(self.funcs))
        if self._loop is None:
            self._loop = _LoopThread()
        try:
            results = self._loop.run(self._score_all(call), self.timeout + LOOP_GRACE_SECONDS)
        except TimeoutError:
            # The loop is stuck in a blocking async function: abandon it (daemon) and use a new one.
            self._loop = None
            message = (
                "did not finish: the event loop was blocked, so an async reward function does "
                "blocking work; use `await asyncio.sleep` / async clients, or make it a plain function"
            )
            results = [(Outcome([NAN] * len(call), [(None, message)]), self.timeout) for _ in self.funcs]
        if self._pool_needs_reset:
            self._discard_process_pool()
        return self._batch([outcome for outcome, _ in results], [seconds for _, seconds in results])

    def close(self) -> None:
        """Stop the event loop and the process pool."""
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        if self._process_pool is not None:
            self._process_pool.shutdown(wait=True, cancel_futures=True)
            self._process_pool = None

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def _score_all(self, call: RewardCall) -> list[tuple[Outcome, float]]:
        process_call = self._picklable(call) if "process" in self.kinds else call
        jobs = (
            self._score_one(index, process_call if kind == "process" else call)
            for index, kind in enumerate(self.kinds)
        )
        return list(await asyncio.gather(*jobs))

    def _picklable(self, call: RewardCall) -> RewardCall:
        """The call without the arguments that can't be sent to a worker process (TRL-style
        callbacks such as `log_metric`, environments that hold a connection)."""
        columns = {}
        for name, value in call.columns.items():
            try:
                pickle.dumps(value)
            except Exception:
                if name not in self._unsent_arguments:
                    self._unsent_arguments.add(name)
                    logger.warning(
                        "Argument %r can't be pickled, so CPU-heavy reward functions (which run in worker "
                        "processes) don't receive it.",
                        name,
                    )
                continue
            columns[name] = value
        return RewardCall(call.prompts, call.completions, call.completion_ids, columns)

    async def _score_one(self, index: int, call: RewardCall) -> tuple[Outcome, float]:
        fn, kind = self.funcs[index], self.kinds[index]
        start = time.perf_counter()
        overrunning = self._overrunning.get(index)
        if kind == "thread" and overrunning is not None and not overrunning.done():
            message = (
                "was not run: its call from an earlier batch overran reward_timeout and is still running "
                "(a thread cannot be stopped; set cpu_heavy = True on a picklable function to run it "
                "in a process a timeout kills)"
            )
            return Outcome([NAN] * len(call), [(None, message)]), 0.0
        running = None
        try:
            if kind == "async":
                pending = evaluate_async(fn, call)
            elif kind == "process":
                pending = asyncio.wrap_future(self._pool().submit(evaluate, fn, call))
            else:
                running = in_daemon_thread(evaluate, fn, call)
                pending = asyncio.wrap_future(running)
            outcome = await asyncio.wait_for(pending, self.timeout)
        except TimeoutError:
            self._pool_needs_reset |= kind == "process"
            if running is not None:
                self._overran_in_thread(index, running)
            message = (
                f"timed out after {self.timeout:g} s and its values were dropped; raise reward_timeout "
                "if it needs longer, or make it faster"
            )
            outcome = Outcome([NAN] * len(call), [(None, message)])
        except Exception as error:
            outcome = Outcome([NAN] * len(call), [(None, _failure_message(error, kind))])
            self._pool_needs_reset |= isinstance(error, BrokenProcessPool)
        return outcome, time.perf_counter() - start

    def _overran_in_thread(self, index: int, running: concurrent.futures.Future) -> None:
        """Keep a sync function from piling up threads: not started again while `running` runs,
        and moved to the process pool when it can go there."""
        self._overrunning[index] = running
        name = self.names[index]
        if self.num_workers == 0 or not _picklable(self.funcs[index]):
            return
        self.kinds[index] = "process"
        self._pool_needs_reset = True  # the next pool imports the plugin file it comes from
        logger.warning(
            "reward %r overran reward_timeout in a thread, which cannot be stopped; it runs in the "
            "process pool from now on, where a timeout kills it (set cpu_heavy = True to start there)",
            name,
        )

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._process_pool is None:
            heavy = [fn for fn, kind in zip(self.funcs, self.kinds) if kind == "process"]
            self._process_pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.num_workers,
                mp_context=multiprocessing.get_context(self.mp_context),
                initializer=_init_worker,
                initargs=(plugin_files(heavy), list(sys.path)),
            )
        return self._process_pool

    def _discard_process_pool(self) -> None:
        pool, self._process_pool = self._process_pool, None
        self._pool_needs_reset = False
        if pool is None:
            return
        terminate_workers = getattr(pool, "terminate_workers", None)  # Python >= 3.14
        if terminate_workers is not None:
            terminate_workers()
        else:
            # No public way to stop a running task before 3.14: terminate the workers directly.
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)

    def _batch(self, outcomes: list[Outcome], seconds: list[float]) -> RewardBatch:
        values = torch.tensor([outcome.values for outcome in outcomes], dtype=torch.float32).T.contiguous()
        errors = [
            RewardError(name, index, message)
            for name, outcome in zip(self.names, outcomes)
            for index, message in outcome.errors
        ]
        _log_errors(errors)
        return RewardBatch(
            values=values,
            names=list(self.names),
            weights=self.weights.clone(),
            errors=errors,
            seconds_per_func=dict(zip(self.names, seconds)),
        )


class _LoopThread:
    """An asyncio event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="grpoflow-rewards-loop", daemon=True
        )
        self.thread.start()

    def run(self, coroutine: Any, timeout: float) -> Any:
        """Run `coroutine` on the loop and wait for its result (TimeoutError after `timeout` s)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


def _init_worker(files: list[str], sys_path: list[str]) -> None:
    """Process-pool initializer: take the parent's import path (a forkserver keeps the one it
    started with) and re-import the plugin files the CPU-heavy functions come from."""
    sys.path[:] = sys_path
    for path in files:
        import_file(path)


def _picklable(fn: Callable[..., Any]) -> bool:
    try:
        pickle.dumps(fn)
    except Exception:
        return False
    return True


def _kind(fn: Callable[..., Any], num_workers: int) -> str:
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return "async"
    if getattr(fn, "cpu_heavy", False) and num_workers > 0:
        return "process"
    return "thread"


def _check_funcs(names: list[str], funcs: list[Callable[..., Any]]) -> None:
    if not funcs:
        raise ValueError("RewardRunner needs at least one reward function.")
    for name, fn in zip(names, funcs):
        if not callable(fn):
            raise ValueError(
                f"Reward {name!r} is a {type(fn).__name__}, not callable; resolve it with resolve_reward."
            )
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"Reward names must be unique, {duplicates} appear more than once; rename them.")


def _make_call(
    prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any], columns: dict[str, Any]
) -> RewardCall:
    size = len(completions)
    for label, values in (("prompts", prompts), ("completion_ids", completion_ids)):
        if len(values) != size:
            raise ValueError(f"Got {len(values)} {label} for {size} completions; pass one per completion.")
    clashes = sorted({"prompts", "completions", "completion_ids"} & set(columns))
    if clashes:
        raise ValueError(f"Column names {clashes} clash with reward arguments; rename those dataset columns.")
    return RewardCall(list(prompts), list(completions), list(completion_ids), dict(columns))


def _failure_message(error: Exception, kind: str) -> str:
    if isinstance(error, BrokenProcessPool):
        return f"could not run: its worker process died ({error}); the pool is restarted for the next batch"
    message = f"could not run: {type(error).__name__}: {error}"
    if kind == "process":
        message += (
            "; functions marked cpu_heavy run in a process pool and must be picklable: define them "
            "at module level (or in a plugin file), not as lambdas or closures"
        )
    return message


def reward_name(spec: str | Callable[..., Any]) -> str:
    """The name a reward's metrics carry: a registered name as is, the function's name for an
    import path (`pkg.module:fn`, `dir/file.py:fn`, `pkg.module.fn`) or a callable."""
    if isinstance(spec, str):
        return spec.replace("\\", "/").split("/")[-1].split(":")[-1].split(".")[-1]
    return getattr(spec, "__name__", type(spec).__name__)


def _log_errors(errors: list[RewardError]) -> None:
    for error in errors[:MAX_LOGGED_ERRORS]:
        logger.warning("%s", error)
    if len(errors) > MAX_LOGGED_ERRORS:
        logger.warning(
            "... and %d more reward errors in this batch (all counted in rewards/num_errors)",
            len(errors) - MAX_LOGGED_ERRORS,
        )
