"""The GRPO loop: next groups, advantages, learn, sync, log.

The trainer receives its parts built (`grpoflow.run.build`): the source of scored groups
(`grpoflow.rollout.source`), the advantages, the learner (`grpoflow.learn.learner`), the weight
sync, and the run's services (checkpoints, health checks, evaluation); it reads no config section.
One `step` is one generation batch and `num_iterations` optimizer steps on it.

Over several ranks (`grpoflow.distributed`), each rank rolls out, scores and updates on its own
slice of the global generation batch; groups stay whole on one rank, so group advantages need no
communication. The rewards and lengths of every completion (a few numbers each) are gathered so
that batch-wide statistics (`scale_rewards: batch`, the logged means and spreads) are those of the
global batch. Sampling seeds are drawn per prompt of the global batch from the run's own
generator, so a prompt's completions do not depend on how the batch is split over ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from grpoflow.algo import overlong_mask
from grpoflow.data.prompts import PromptItem
from grpoflow.distributed import DistributedContext
from grpoflow.engines import NonFiniteLogits, RolloutEngine
from grpoflow.learn.learner import Learner
from grpoflow.learn.objective import StepAdvantages
from grpoflow.phases import PhaseTimer, phase
from grpoflow.policy.placement import Placement
from grpoflow.rollout.batch import RolloutBatch, collate
from grpoflow.rollout.groups import ScoredGroups
from grpoflow.rollout.source import GroupSource, engine_awake
from grpoflow.run import checkpoint
from grpoflow.run.evaluation import BestCheckpoint, EvalConfig, Evaluator
from grpoflow.run.failures import (
    RewardFailureStreaks,
    RunStopped,
    batches_timeout_message,
    episode_failure_message,
    reward_failure_message,
    server_failure_message,
    sync_failure_message,
)
from grpoflow.run.health import Finding, HealthMonitor, stop_message
from grpoflow.run.metrics import StepLog
from grpoflow.run.step_metrics import (
    batch_metrics,
    completion_rows,
    length_columns,
    rank_metrics,
    time_metrics,
)
from grpoflow.run.weight_sync import WeightSync
from grpoflow.transport import ServerError, WeightSyncError

logger = logging.getLogger("grpoflow")

EPISODES = "episodes"
"""The one name of the streak of steps on which every episode failed."""


@dataclass(kw_only=True, slots=True)
class LoopSettings:
    """What the loop itself reads of the run's config (`GRPOConfig.loop_settings`)."""

    total_steps: int
    steps_per_epoch: float | None
    """Steps that take every training prompt once (None: the prompts come from a service)."""
    logging_steps: int
    """Steps between metric lines (`logging_steps`)."""
    log_completions: bool
    mask_truncated_completions: bool
    """Truncated completions carry no loss (DAPO's overlong filtering)."""
    kl_in_reward: bool
    """beta x each completion's KL to the reference is taken from its reward before advantages."""
    stop_on_nonfinite: bool
    """Non-finite logits stop the run after a checkpoint (`health_nonfinite` not off)."""
    max_consecutive_reward_failures: int
    eval: EvalConfig
    flat_config: dict
    """The run's settings as flat keys, kept in every checkpoint."""


class GRPOTrainer:
    """Runs GRPO on the groups of a source with a learner, syncing the engine's weights."""

    def __init__(
        self,
        settings: LoopSettings,
        *,
        source: GroupSource,
        advantages: StepAdvantages,
        learner: Learner,
        engine: RolloutEngine,
        weight_sync: WeightSync,
        checkpoints: checkpoint.Checkpointer,
        health: HealthMonitor,
        tokenizer,
        placement: Placement,
        ref_placement: Placement | None = None,
        distributed: DistributedContext | None = None,
        evaluator: Evaluator | None = None,
        cleanups: Sequence[Callable[[], None]] = (),
        observers: Sequence[Callable[[int, dict[str, float]], None]] = (),
    ) -> None:
        """`placement` and `ref_placement` hold the policy and the reference model as
        `place_models` laid them out; `engine` generates (and evaluates) with the policy's
        weights as `weight_sync` hands them over. `evaluator`: evaluates on held-out prompts as
        the eval section says. `cleanups` run in `close()` (servers the run started);
        `observers` are given each step's number and metrics by `observe` (`train` calls it once
        a step is logged)."""
        self.settings, self.source, self.advantages, self.learner = settings, source, advantages, learner
        self.engine, self.weight_sync, self.checkpoints = engine, weight_sync, checkpoints
        self.tokenizer, self.placement, self.ref_placement = tokenizer, placement, ref_placement
        self.distributed = distributed or DistributedContext()
        self.evaluator, self.cleanups, self.observers = evaluator, list(cleanups), list(observers)
        self.health = health
        self.best = BestCheckpoint(settings.eval, checkpoints.output_dir)
        """The best metric_for_best_model so far (its checkpoint is checkpoint-best)."""
        self.reward_names = list(source.reward_names)
        self.step_count = 0
        self.num_tokens = 0
        self.last_reward_errors: list = []
        self.last_episode_error: str | None = None
        """The first error of the latest step's failed episodes, if any."""
        self.episode_streak = RewardFailureStreaks([EPISODES], settings.max_consecutive_reward_failures)
        """Steps in a row on which every episode failed."""

    @property
    def total_steps(self) -> int:
        return self.settings.total_steps

    @property
    def model(self) -> torch.nn.Module:
        """The policy being trained."""
        return self.placement.module

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The reference model of the KL term (None at beta 0)."""
        return self.ref_placement.module if self.ref_placement is not None else None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.learner.optimizer

    def train(self, metrics_logger: StepLog | None = None) -> list[dict[str, float]]:
        """Run to `total_steps`, logging and checkpointing; returns each step's metrics.

        A step's `time/...` phases cover everything between writing the previous step's metrics
        and writing its own: its evaluation, health checks and checkpoint included, and, as
        `time/log`, the writing of the previous step's metrics (a line cannot hold the time it
        takes to write itself)."""
        history = []
        settings = self.settings
        streaks = RewardFailureStreaks(self.reward_names, settings.max_consecutive_reward_failures)
        self.source.start(self.total_steps, self.step_count)
        if self.evaluator is not None and settings.eval.eval_on_start and self.step_count == 0:
            start_metrics = self.evaluate()
            if metrics_logger is not None:
                metrics_logger.log(0, start_metrics)
        try:
            self._loop(metrics_logger, streaks, history)
        finally:
            self.source.settle()  # nothing generates in the background once train returns
        return history

    def _loop(
        self,
        metrics_logger: StepLog | None,
        streaks: RewardFailureStreaks,
        history: list[dict[str, float]],
    ) -> None:
        log_seconds = 0.0
        while self.step_count < self.total_steps:
            if metrics_logger is not None:
                metrics_logger.begin(self.step_count + 1)
            timer = PhaseTimer()
            timer.add("log", log_seconds)
            with timer.active(), timer.measure():
                metrics = self._checked_step(metrics_logger, timer)
                evaluated, stop = self._after_step(metrics, streaks)
            metrics.update(time_metrics(timer))
            history.append(metrics)
            started = time.perf_counter()
            if metrics_logger is not None:
                if self.step_count % self.settings.logging_steps == 0 or evaluated:
                    metrics_logger.log(self.step_count, metrics)
                metrics_logger.advance(self.step_count, metrics)
            self.observe(metrics)
            log_seconds = time.perf_counter() - started
            if stop is not None:
                raise stop

    def observe(self, metrics: dict[str, float]) -> None:
        """Hand the last step's number and metrics to the observers (`train` does after each
        step; a caller stepping the trainer itself does so to keep what they record)."""
        for observe in self.observers:
            observe(self.step_count, metrics)

    def step(self, metrics_logger: StepLog | None = None) -> dict[str, float]:
        """One generation batch: next groups, advantages, learn, sync; its metrics with its
        `time/...` phases (`train` also counts evaluation, checkpoints and logging)."""
        timer = PhaseTimer()
        with timer.active(), timer.measure():
            metrics = self._step(metrics_logger, timer)
        return {**metrics, **time_metrics(timer)}

    def _step(self, metrics_logger: StepLog | None, timer: PhaseTimer) -> dict[str, float]:
        scored = self._next_groups()
        self.last_reward_errors = scored.errors
        self.last_episode_error = _first_error(scored)
        batch = self._collate(scored)
        if self.step_count + 1 < self.total_steps:
            self.source.ahead(self.step_count + 1)
        with phase("gather"):  # one row per completion of the global batch, rank after rank
            all_rewards = self.distributed.all_gather(scored.rewards)
            all_lengths = self.distributed.all_gather(length_columns(batch))
        all_kl = self._reward_kl(batch)
        with phase("advantages"):
            advantages, reward_metrics = self.advantages(all_rewards, scored, all_kl)
        with phase("update"):
            update_metrics = self.learner.learn(
                batch, advantages.to(self.placement.device), sampling_logprobs=_carries_logprobs(scored)
            )
        self.source.settle()  # weights never change under a running generation
        self.step_count += 1
        check_metrics = self.weight_sync.after_step(self.step_count)
        with phase("metrics"):
            self.num_tokens += int(all_lengths[:, 3].sum() + all_lengths[:, 2].sum())
            metrics = self._metrics(scored, batch, {**update_metrics, **check_metrics}, timer)
            metrics.update({name: float(value) for name, value in reward_metrics.items()})
            metrics.update(batch_metrics(all_rewards, all_lengths, self.reward_names))
        if self.settings.log_completions:
            with phase("log"):
                self._log_completions(scored, advantages, metrics_logger)
        return metrics

    def _next_groups(self) -> ScoredGroups:
        try:
            return self.source.next(self.step_count)
        except TimeoutError as error:  # no groups came in time (Atropos)
            raise RunStopped(
                batches_timeout_message(error, self.step_count + 1, self._saved_so_far())
            ) from None

    def _collate(self, scored: ScoredGroups) -> RolloutBatch:
        with phase("collate"):
            batch = collate(scored.groups, self.tokenizer.pad_token_id, self.placement.device)
            if self.settings.mask_truncated_completions:
                batch.loss_mask = overlong_mask(batch.loss_mask, batch.truncated)
        return batch

    def _reward_kl(self, batch: RolloutBatch) -> torch.Tensor | None:
        """Every completion's KL to the reference under kl_in_reward, gathered over ranks."""
        if not (self.settings.kl_in_reward and self.ref_placement is not None):
            return None
        with phase("reward_kl"):
            kl = self.learner.reward_kl(batch)
        with phase("gather"):
            return self.distributed.all_gather(kl)

    def _metrics(
        self, scored: ScoredGroups, batch: RolloutBatch, local: dict[str, float], timer: PhaseTimer
    ) -> dict[str, float]:
        """The step's metrics averaged over ranks, with the run's counters."""
        rollout_seconds = timer.seconds["rollout"] or timer.background["rollout"]
        rank = rank_metrics(scored, batch, rollout_seconds, self.reward_names, self.placement.device)
        metrics = self.distributed.reduce_metrics({**local, **rank})
        metrics["num_tokens"] = float(self.num_tokens)
        metrics["learning_rate"] = self.learner.scheduler.get_last_lr()[0]
        metrics["dynamic_sample/rounds"] = float(scored.rounds)
        if self.source.makes_ahead:
            metrics["async/staleness"] = float(scored.staleness)
        return metrics

    def _log_completions(
        self, scored: ScoredGroups, advantages: torch.Tensor, metrics_logger: StepLog | None
    ) -> None:
        rows = self.distributed.gather_objects(
            completion_rows(scored.groups, scored.rewards, advantages, self.reward_names)
        )
        if metrics_logger is not None and rows is not None:
            metrics_logger.log_completions(self.step_count, [row for part in rows for row in part])

    def _checked_step(self, metrics_logger: StepLog | None, timer: PhaseTimer) -> dict[str, float]:
        """`_step`, turning a failure into a stop: after a checkpoint where a step was taken."""
        try:
            return self._step(metrics_logger, timer)
        except NonFiniteLogits as error:
            if not self.settings.stop_on_nonfinite:
                raise
            step = self.step_count + 1
            raise self._health_stop(
                [Finding("nonfinite", step, self.step_count, str(error), "stop")]
            ) from error
        except ServerError as error:  # past its retries; this step changed nothing yet
            raise RunStopped(
                server_failure_message(error, self.step_count + 1, self._saved_so_far())
            ) from None
        except WeightSyncError as error:  # past its retries, after the step's update
            retries = self.weight_sync.retries
            raise RunStopped(sync_failure_message(error, self.step_count, retries, self.save())) from None

    def _saved_so_far(self) -> Path | str:
        return self.save() if self.step_count else "none (no step was taken)"

    def _after_step(
        self, metrics: dict[str, float], streaks: RewardFailureStreaks
    ) -> tuple[bool, RunStopped | None]:
        """Evaluate when due, check health and reward failures, checkpoint when due (or to stop).
        Returns whether it evaluated, and the error that stops the run once the step's metrics
        are logged."""
        evaluation = self.settings.eval
        evaluated = self.evaluator is not None and evaluation.due(
            self.step_count, self.total_steps, self.settings.logging_steps
        )
        if evaluated:
            with phase("eval"):
                metrics.update(self.evaluate())
        with phase("health"):
            findings = self.health.update(self.step_count, metrics)
            failing = streaks.update(
                {name for name in self.reward_names if metrics[f"rewards/{name}/failed_all"] == 1.0}
            )
            episodes_failing = self.episode_streak.update(
                {EPISODES} if metrics.get("episodes/failed_fraction") == 1.0 else set()
            )
        saved = None
        if self.checkpoints.is_due(self.step_count, self.total_steps):
            saved = self.save()
        if evaluated and evaluation.metric_for_best_model is not None:
            with phase("checkpoint"):
                self.best.consider(self.step_count, metrics, saved, self.save, self.distributed)
        stop = self._health_stop(findings, saved)
        if stop is None and episodes_failing is not None:
            saved = saved or self.save()
            limit, error = self.episode_streak.limit, self.last_episode_error
            stop = RunStopped(episode_failure_message(limit, self.step_count, saved, error))
        if stop is None and failing is not None:
            saved = saved or self.save()
            errors = self.last_reward_errors
            stop = RunStopped(reward_failure_message(failing, streaks.limit, self.step_count, saved, errors))
        return evaluated, stop

    def evaluate(self, items: Sequence[PromptItem] | None = None) -> dict[str, float]:
        """Evaluate the current policy on the eval prompts, or on `items` (`eval/...` metrics,
        global)."""
        if self.evaluator is None:
            raise ValueError("this run has no eval_dataset to evaluate on")
        evaluator = self.evaluator if items is None else self.evaluator.on(items)
        self.source.settle()  # the engine is free once the groups made ahead are done
        with engine_awake(self.engine, self.placement):
            result = evaluator(self.engine)
        return result.metrics

    def _health_stop(self, findings: list[Finding], saved: Path | None = None) -> RunStopped | None:
        """The error that stops the run on the first finding whose action is stop (after a
        checkpoint: `saved`, or one written now); None when no finding stops it."""
        stop = next((finding for finding in findings if finding.action == "stop"), None)
        if stop is None:
            return None
        saved = saved or self.save()
        return RunStopped(stop_message(stop, saved, self.checkpoints.by_step()))

    def close(self) -> None:
        """Release what the run holds: the source's workers and threads, the run's servers."""
        self.source.close()
        for function in reversed(self.cleanups):
            function()
        self.cleanups.clear()

    def state_dict(self) -> dict:
        return {
            "step": self.step_count,
            "num_tokens": self.num_tokens,
            **self.learner.state_dict(),
            **self.source.state_dict(),
            "rng": checkpoint.rng_state(),
            "config": self.settings.flat_config,
            "best_metric": self.best.value,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step_count, self.num_tokens = state["step"], state["num_tokens"]
        self.best.value = state.get("best_metric")
        self.learner.load_state_dict(state)
        if not self.source.load_state_dict(state):
            logger.warning(
                "the checkpoint holds no sampling-seed state: sampling restarts from the run's seed"
            )
        distributed = self.distributed
        checkpoint.set_rng_state(checkpoint.rank_rng_state(state, distributed.rank, distributed.world_size))
        self.weight_sync.send(self.step_count)

    def save(self) -> Path:
        """Write a checkpoint of the steps taken so far."""
        return self.checkpoints.save(self.step_count, self.state_dict())


def _first_error(scored: ScoredGroups) -> str | None:
    """The message of the first completion that failed (an episode, or the engine's error)."""
    failed = (c for group in scored.groups for c in group.completions if c.finish_reason == "error")
    return next((c.text or "no message" for c in failed), None)


def _carries_logprobs(scored: ScoredGroups) -> bool:
    """Whether every completion carries its sampling log-probs (the importance-sampling
    correction and the logged sampler gap need them)."""
    return scored.sampling_logprobs and all(group.sampling_logprobs for group in scored.groups)
