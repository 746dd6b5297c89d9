"""The GRPO loop: sample prompts, roll out, score, compute advantages, update, sync, log.

The trainer receives its parts (model, engine, rewards, prompts, logger) ready-made; `build.py`
builds them from a config. One `step` is one generation batch and `num_iterations` optimizer
steps on it.

Over several ranks (`grpoflow.distributed`), each rank rolls out, scores and updates on its own
slice of the global generation batch; groups stay whole on one rank, so group advantages need no
communication. The rewards and lengths of every completion (a few numbers each) are gathered so
that batch-wide statistics (`scale_rewards: batch`, the logged means and spreads) are those of the
global batch. Sampling seeds are drawn per prompt of the global batch from the run's own
generator, so a prompt's completions do not depend on how the batch is split over ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from grpoflow.algo import check_packed_attention, overlong_mask
from grpoflow.data.prompts import PromptItem
from grpoflow.distributed import DistributedContext
from grpoflow.engines import NonFiniteLogits, RolloutEngine
from grpoflow.learn.objective import rank_advantages
from grpoflow.phases import PhaseTimer, phase
from grpoflow.policy.placement import Placement
from grpoflow.rewards import RewardRunner
from grpoflow.rollout.batch import RolloutBatch, collate
from grpoflow.rollout.groups import Rollout, ScoredBatches, ScoredGroups, SingleTurn
from grpoflow.rollout.prefetch import RolloutPrefetcher
from grpoflow.rollout.prompt_draws import PromptDraws
from grpoflow.rollout.scoring import RolloutScorer
from grpoflow.run import checkpoint
from grpoflow.run.config import GRPOConfig
from grpoflow.run.evaluation import BestCheckpoint, Evaluator
from grpoflow.run.failures import (
    RewardFailureStreaks,
    RunStopped,
    batches_timeout_message,
    reward_failure_message,
    server_failure_message,
    sync_failure_message,
    sync_with_retries,
)
from grpoflow.run.health import Finding, HealthMonitor, stop_message
from grpoflow.run.metrics import MetricsLogger
from grpoflow.run.step_metrics import (
    batch_metrics,
    completion_rows,
    length_columns,
    rank_metrics,
    time_metrics,
)
from grpoflow.run.sync_check import SyncCheck, probe_ids
from grpoflow.transport import ServerError, WeightSyncError

logger = logging.getLogger("grpoflow")


class GRPOTrainer:
    """Runs GRPO on prompts with a rollout engine and reward functions."""

    def __init__(
        self,
        config: GRPOConfig,
        *,
        tokenizer,
        engine: RolloutEngine,
        rewards: RewardRunner | None,
        items: list[PromptItem],
        optimizer: torch.optim.Optimizer,
        scheduler,
        placement: Placement,
        ref_placement: Placement | None = None,
        distributed: DistributedContext | None = None,
        per_prompt_seeds: bool = False,
        run_id: str | None = None,
        rollout: Rollout | None = None,
        batches: ScoredBatches | None = None,
        evaluator: Evaluator | None = None,
    ) -> None:
        """`per_prompt_seeds`: the engine takes one SamplingParams per prompt (the native engine),
        so each prompt is sampled from its own seed; otherwise one seed per call and rank.
        `placement` and `ref_placement` hold the policy and the reference model as `place_models`
        laid them out. `run_id` marks the run's checkpoints (see `grpoflow.run.output_dir`).
        `rollout`: turns prompts into groups (default: one sampled completion per member;
        `grpoflow.rollout.groups.Episodes` plays multi-turn episodes). `batches`: scored groups
        from elsewhere (Atropos), taken instead of sampling `items` and scoring with `rewards`;
        `engine` then only receives the weights. `evaluator`: evaluates on held-out prompts as
        the eval section says."""
        self.config, self.tokenizer, self.run_id = config, tokenizer, run_id
        self.last_reward_errors: list = []
        self.rollout = rollout or SingleTurn(tokenizer)
        self.engine, self.rewards, self.items, self.batches = engine, rewards, items, batches
        self.evaluator = evaluator
        self.estimate_advantages = config.algorithm.advantage_estimator()
        self.entropy_control = config.algorithm.entropy_control()
        self.health = HealthMonitor(config.health)
        self.best = BestCheckpoint(config.eval, config.training.output_dir)
        """The best metric_for_best_model so far (its checkpoint is checkpoint-best)."""
        if batches is not None:
            self.reward_names = list(batches.reward_names)
            self.reward_weights = torch.ones(len(self.reward_names))
        elif rewards is not None:
            self.reward_names, self.reward_weights = list(rewards.names), rewards.weights
        else:
            raise ValueError("GRPOTrainer needs rewards to score its rollouts, or scored batches")
        self.optimizer, self.scheduler = optimizer, scheduler
        self.placement, self.ref_placement = placement, ref_placement
        self.device = placement.device
        self.distributed = distributed or DistributedContext()
        self.num_prompts = config.generation_batch_size // config.generation.num_generations
        self.total_steps = config.total_steps(len(items), self.distributed.world_size)
        self.step_count = 0
        self.num_tokens = 0
        self.sync_failure: WeightSyncError | None = None
        self.sampling = config.step_sampling(tokenizer.eos_token_id)
        self.draws = PromptDraws(
            len(items),
            seed=config.training.seed,
            shuffle=config.data.dataset_shuffle,
            sampling=self.sampling,
            distributed=self.distributed,
            per_prompt_seeds=per_prompt_seeds,
        )
        copies_weights = not engine.shares_policy_weights
        sync = config.sync
        self.sync_check = (
            SyncCheck(probe_ids(items, tokenizer), tolerance=sync.weight_sync_check_tolerance)
            if sync.weight_sync_check and copies_weights
            else None
        )
        if config.training.padding_free:
            check_packed_attention(placement.module)
        self.update_settings = config.update_settings(copies_weights)
        self.scorer = RolloutScorer(
            rollout=self.rollout,
            engine=engine,
            rewards=rewards,
            draws=self.draws,
            items=items,
            reward_weights=self.reward_weights,
            dynamic_sample=config.algorithm.dynamic_sample,
            max_resample_times=config.algorithm.max_resample_times,
            num_generations=config.generation.num_generations,
            num_prompts=self.num_prompts,
            distributed=self.distributed,
        )
        self._cleanups: list[Callable[[], None]] = []
        self.prefetcher: RolloutPrefetcher[ScoredGroups] | None = (
            RolloutPrefetcher() if config.off_policy.async_generate else None
        )

    @property
    def model(self) -> torch.nn.Module:
        """The policy being trained."""
        return self.placement.module

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The reference model of the KL term (None at beta 0)."""
        return self.ref_placement.module if self.ref_placement is not None else None

    def train(self, metrics_logger: MetricsLogger | None = None) -> list[dict[str, float]]:
        """Run to `total_steps`, logging and checkpointing; returns each step's metrics.

        A step's `time/...` phases cover everything between writing the previous step's metrics
        and writing its own: its evaluation, health checks and checkpoint included, and, as
        `time/log`, the writing of the previous step's metrics (a line cannot hold the time it
        takes to write itself)."""
        history = []
        streaks = RewardFailureStreaks(self.reward_names, self.config.rewards.max_consecutive_reward_failures)
        evaluation = self.config.eval
        try:
            if self.evaluator is not None and evaluation.eval_on_start and self.step_count == 0:
                start_metrics = self.evaluate()
                if metrics_logger is not None:
                    metrics_logger.log(0, start_metrics)
            log_seconds = 0.0
            while self.step_count < self.total_steps:
                timer = PhaseTimer()
                timer.add("log", log_seconds)
                with timer.active(), timer.measure():
                    metrics = self._checked_step(metrics_logger, timer)
                    evaluated, stop = self._after_step(metrics, streaks)
                metrics.update(time_metrics(timer))
                history.append(metrics)
                started = time.perf_counter()
                if metrics_logger is not None:
                    if self.step_count % self.config.log.logging_steps == 0 or evaluated:
                        metrics_logger.log(self.step_count, metrics)
                    metrics_logger.advance(self.step_count, metrics)
                log_seconds = time.perf_counter() - started
                if stop is not None:
                    raise stop
        finally:
            if self.prefetcher is not None:
                self.prefetcher.close()
        return history

    def _checked_step(self, metrics_logger: MetricsLogger | None, timer: PhaseTimer) -> dict[str, float]:
        """`step`, turning a failure into a stop: after a checkpoint where a step was taken."""
        try:
            metrics = self._step(metrics_logger, timer)
        except NonFiniteLogits as error:
            if self.config.health.health_nonfinite == "off":
                raise
            step = self.step_count + 1
            raise self._health_stop(
                [Finding("nonfinite", step, self.step_count, str(error), "stop")]
            ) from error
        except ServerError as error:  # past its retries; this step changed nothing yet
            saved = self.save() if self.step_count else "none (no step was taken)"
            raise RunStopped(server_failure_message(error, self.step_count + 1, saved)) from None
        if self.sync_failure is not None:
            retries, failure, self.sync_failure = (
                self.config.sync.weight_sync_retries,
                self.sync_failure,
                None,
            )
            raise RunStopped(sync_failure_message(failure, self.step_count, retries, self.save())) from None
        return metrics

    def _after_step(
        self, metrics: dict[str, float], streaks: RewardFailureStreaks
    ) -> tuple[bool, RunStopped | None]:
        """Evaluate when due, check health and reward failures, checkpoint when due (or to stop).
        Returns whether it evaluated, and the error that stops the run once the step's metrics
        are logged."""
        evaluation = self.config.eval
        evaluated = self.evaluator is not None and evaluation.due(
            self.step_count, self.total_steps, self.config.log.logging_steps
        )
        if evaluated:
            with phase("eval"):
                metrics.update(self.evaluate())
        with phase("health"):
            findings = self.health.update(self.step_count, metrics)
            failing = streaks.update(
                {name for name in self.reward_names if metrics[f"rewards/{name}/failed_all"] == 1.0}
            )
        saved = None
        if self.config.training.saves_at(self.step_count, self.total_steps):
            saved = self.save()
        if evaluated and evaluation.metric_for_best_model is not None:
            with phase("checkpoint"):
                self.best.consider(self.step_count, metrics, saved, self.save, self.distributed)
        stop = self._health_stop(findings, saved)
        if stop is None and failing is not None:
            saved = saved or self.save()
            errors = self.last_reward_errors
            stop = RunStopped(reward_failure_message(failing, streaks.limit, self.step_count, saved, errors))
        return evaluated, stop

    def evaluate(self) -> dict[str, float]:
        """Evaluate the current policy on the eval prompts (`eval/...` metrics, global)."""
        if self.evaluator is None:
            raise ValueError("this run has no eval_dataset to evaluate on")
        if self.prefetcher is not None:
            self.prefetcher.wait()  # the engine is free once the batch generated ahead is done
        with self._engine_awake():
            result = self.evaluator(self.engine)
        return result.metrics

    def _health_stop(self, findings: list[Finding], saved: Path | None = None) -> RunStopped | None:
        """The error that stops the run on the first finding whose action is stop (after a
        checkpoint: `saved`, or one written now); None when no finding stops it."""
        stop = next((finding for finding in findings if finding.action == "stop"), None)
        if stop is None:
            return None
        saved = saved or self.save()
        output_dir = self.config.training.output_dir
        steps = {checkpoint.checkpoint_step(path): path for path in checkpoint.list_checkpoints(output_dir)}
        return RunStopped(stop_message(stop, saved, steps))

    def step(self, metrics_logger: MetricsLogger | None = None) -> dict[str, float]:
        """One generation batch: roll out, score, compute advantages, update, sync; its metrics
        with its `time/...` phases (`train` also counts evaluation, checkpoints and logging)."""
        timer = PhaseTimer()
        with timer.active(), timer.measure():
            metrics = self._step(metrics_logger, timer)
        return {**metrics, **time_metrics(timer)}

    def _step(self, metrics_logger: MetricsLogger | None, timer: PhaseTimer) -> dict[str, float]:
        scored, staleness = self._rollout(timer)
        self.last_reward_errors = scored.errors
        with phase("collate"):
            batch = collate(scored.groups, self.tokenizer.pad_token_id, self.device)
            if self.config.algorithm.mask_truncated_completions:
                batch.loss_mask = overlong_mask(batch.loss_mask, batch.truncated)
        if self.prefetcher is not None and self.step_count + 1 < self.total_steps:
            with phase("rollout_launch"):
                self._launch_prefetch()
        with phase("gather"):  # one row per completion of the global batch, rank after rank
            all_rewards = self.distributed.all_gather(scored.rewards)
            all_lengths = self.distributed.all_gather(length_columns(batch))
        all_kl = None
        if self.config.algorithm.kl_in_reward and self.ref_placement is not None:
            with phase("reward_kl"):
                kl = reward_kl(
                    self.placement, self.ref_placement, batch, self.update_settings, self.distributed
                )
            with phase("gather"):
                all_kl = self.distributed.all_gather(kl)
        with phase("advantages"):
            advantages, reward_metrics = self._advantages(all_rewards, scored, all_kl)
        with phase("update"):
            update_metrics = self._update(batch, advantages, scored)
        if self.prefetcher is not None:
            with phase("rollout_wait"):
                self.prefetcher.wait()  # weights never change under a running generation
        check_metrics = self._sync_weights()
        self.step_count += 1
        with phase("metrics"):
            self.num_tokens += int(all_lengths[:, 3].sum() + all_lengths[:, 2].sum())
            rollout_seconds = timer.seconds["rollout"] or timer.background["rollout"]
            rollout_metrics = self.rollout.last_metrics if self.batches is None else {}
            rank = rank_metrics(
                scored, batch, rollout_seconds, self.reward_names, self.device, rollout_metrics
            )
            metrics = self.distributed.reduce_metrics({**update_metrics, **check_metrics, **rank})
            metrics.update({name: float(value) for name, value in reward_metrics.items()})
            metrics.update(batch_metrics(all_rewards, all_lengths, self.reward_names))
            metrics["num_tokens"] = float(self.num_tokens)
            metrics["learning_rate"] = self.scheduler.get_last_lr()[0]
            metrics["dynamic_sample/rounds"] = float(scored.rounds)
            if self.prefetcher is not None:
                metrics["async/staleness"] = float(staleness)
        if self.config.log.log_completions:
            with phase("log"):
                rows = self.distributed.gather_objects(
                    completion_rows(scored.groups, scored.rewards, advantages, self.reward_names)
                )
                if metrics_logger is not None and rows is not None:
                    metrics_logger.log_completions(self.step_count, [row for part in rows for row in part])
        return metrics

    def _update(
        self, batch: RolloutBatch, advantages: torch.Tensor, scored: ScoredGroups
    ) -> dict[str, float]:
        settings = self.update_settings
        if not (scored.sampling_logprobs and all(group.sampling_logprobs for group in scored.groups)):
            settings = dataclasses.replace(settings, sampling_correction=None, sampling_logprobs=False)
        return update_policy(
            self.placement,
            self.optimizer,
            self.scheduler,
            batch,
            advantages.to(self.device),
            settings,
            self.ref_placement,
            self.distributed,
            self.entropy_control,
        )

    def _sync_weights(self) -> dict[str, float]:
        """Send the updated weights to the engine when a sync is due, then check them (when on)."""
        if (self.step_count + 1) % self.config.sync.weight_sync_interval != 0:
            return {}
        version = self.step_count + 1
        with phase("sync"):
            self.sync_failure = sync_with_retries(
                lambda: self.engine.update_weights(self.placement.rollout_weights(self.engine), version),
                self.config.sync.weight_sync_retries,
                version,
            )
        if self.sync_check is None:
            return {}
        with phase("sync_check"):
            return self.sync_check(self.engine, self.placement, step=version)

    def _rollout(self, timer: PhaseTimer) -> tuple[ScoredGroups, int]:
        """This step's scored groups, prefetched or generated now, and their staleness: policy
        versions between the weights that sampled them and the policy they update."""
        if self.batches is not None:
            self.batches.policy_version = self.step_count
            with phase("rollout_wait"):
                try:
                    return self.batches.next(), 0
                except TimeoutError as error:
                    saved = self.save() if self.step_count else "none (no step was taken)"
                    raise RunStopped(batches_timeout_message(error, self.step_count + 1, saved)) from None
        if self.prefetcher is not None and self.prefetcher.pending:
            with phase("rollout_wait"):
                fresh = self.prefetcher.take_fresh(
                    self.step_count, self.config.off_policy.max_staleness, ScoredGroups.oldest_version
                )
            if fresh is not None:
                for name, seconds in fresh[0].seconds.items():
                    timer.background[name] += seconds
                return fresh[0].value, fresh[1]
        with self._engine_awake():
            scored = self.scorer()
        return scored, self.step_count - self.engine.policy_version

    @contextmanager
    def _engine_awake(self) -> Iterator[None]:
        """The engine awake and the policy laid out for it (merged adapters, gathered shards)."""
        with phase("wake_up"):
            self.engine.wake_up()
        with self.placement.rollout_context(self.engine):
            yield
        with phase("sleep"):
            self.engine.sleep()

    def _launch_prefetch(self) -> None:
        """Start generating the next step's batch in the background (its own timer: the
        seconds it takes overlap the update and are logged as `time/background/...`)."""

        def produce() -> tuple[ScoredGroups, dict[str, float]]:
            timer = PhaseTimer(synchronize=False)
            with timer.active():
                return self.scorer(), dict(timer.seconds)

        assert self.prefetcher is not None
        self.prefetcher.launch(produce, self._sampling_state())

    def _sampling_state(self) -> dict:
        return self.draws.state_dict()

    def _advantages(
        self, all_rewards: torch.Tensor, scored: ScoredGroups, all_kl: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's advantages (batch,) and the reward metrics (`rank_advantages`)."""
        size, rank = len(all_rewards) // self.distributed.world_size, self.distributed.rank
        return rank_advantages(
            self.config.algorithm,
            self.estimate_advantages,
            all_rewards,
            self.reward_weights,
            scored.group_sizes or self.config.generation.num_generations,
            slice(rank * size, (rank + 1) * size),
            scored.zero_advantage,
            all_kl,
        )

    def add_cleanup(self, function: Callable[[], None]) -> None:
        """Call `function` in `close()` (e.g. to stop rollout servers the run started)."""
        self._cleanups.append(function)

    def close(self) -> None:
        """Release what the run holds: reward workers, the rollout thread, the run's servers."""
        if self.rewards is not None:
            self.rewards.close()
        if self.batches is not None:
            self.batches.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        for function in reversed(self._cleanups):
            function()
        self._cleanups.clear()

    def state_dict(self) -> dict:
        # A batch generated ahead is not in the checkpoint: resuming generates it again.
        sampling = (self.prefetcher and self.prefetcher.resume_state) or self._sampling_state()
        return {
            "step": self.step_count,
            "num_tokens": self.num_tokens,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            **sampling,
            "rng": checkpoint.rng_state(),
            "config": self.config.to_flat_dict(),
            "best_metric": self.best.value,
            "entropy_control": self.entropy_control.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step_count, self.num_tokens = state["step"], state["num_tokens"]
        self.best.value = state.get("best_metric")
        self.entropy_control.load_state_dict(state.get("entropy_control"))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if not self.draws.load_state_dict(state):
            logger.warning(
                "the checkpoint holds no sampling-seed state: sampling restarts from the run's seed"
            )
        distributed = self.distributed
        checkpoint.set_rng_state(checkpoint.rank_rng_state(state, distributed.rank, distributed.world_size))
        self.engine.update_weights(self.placement.rollout_weights(self.engine), self.step_count)

    def save(self) -> Path:
        """Write a checkpoint (rank 0 writes, holding every rank's RNG state; the others wait)."""
        training = self.config.training
        with phase("checkpoint"):
            return checkpoint.save_placed_checkpoint(
                training.output_dir,
                self.step_count,
                placement=self.placement,
                tokenizer=self.tokenizer,
                trainer_state=self.state_dict(),
                distributed=self.distributed,
                save_total_limit=training.save_total_limit,
                run_id=self.run_id,
            )
