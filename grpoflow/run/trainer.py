"""The GRPO loop: sample prompts, roll out, score, compute advantages, update, sync, log.

The trainer receives its parts (model, engine, rewards, prompts, logger) ready-made; `build.py`
builds them from a config. One `step` is one generation batch and `num_iterations` optimizer
steps on it.

Over several ranks (`grpoflow.run.distributed`), each rank rolls out, scores and updates on its own
slice of the global generation batch; groups stay whole on one rank, so group advantages need no
communication. The rewards and lengths of every completion (a few numbers each) are gathered so
that batch-wide statistics (`scale_rewards: batch`, the logged means and spreads) are those of the
global batch. Sampling seeds are drawn per prompt of the global batch from the run's own
generator, so a prompt's completions do not depend on how the batch is split over ranks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from grpoflow.algo import check_packed_attention, combine_rewards, overlong_mask, zero_std_groups
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import NonFiniteLogits, RolloutEngine
from grpoflow.policy.placement import Placement
from grpoflow.rewards import RewardRunner
from grpoflow.run import checkpoint
from grpoflow.run.algorithm import batch_advantages
from grpoflow.run.config import GRPOConfig
from grpoflow.run.distributed import DistributedContext
from grpoflow.run.evaluation import Evaluator
from grpoflow.run.failures import (
    RewardFailureStreaks,
    RunStopped,
    reward_failure_message,
    server_failure_message,
    sync_failure_message,
    sync_with_retries,
)
from grpoflow.run.health import Finding, HealthMonitor, stop_message
from grpoflow.run.metrics import MetricsLogger
from grpoflow.run.prefetch import RolloutPrefetcher
from grpoflow.run.prompt_draws import PromptDraws
from grpoflow.run.rollout import (
    Rollout,
    ScoredBatches,
    ScoredGroups,
    SingleTurn,
    collate,
    merge_groups,
    reward_inputs,
    subset_groups,
)
from grpoflow.run.step_metrics import (
    Timer,
    batch_metrics,
    completion_rows,
    length_columns,
    rank_metrics,
)
from grpoflow.run.sync_check import SyncCheck, probe_ids
from grpoflow.run.update import UpdateSettings, reward_kl, update_policy
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
        `grpoflow.run.rollout.Episodes` plays multi-turn episodes). `batches`: scored groups
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
        self.best_metric: float | None = None
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
        eos = tokenizer.eos_token_id
        self.sampling = dataclasses.replace(
            config.generation.sampling,
            n=config.generation.num_generations,
            stop_token_ids=[eos] if eos is not None else [],
        )
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
        correction = config.off_policy.correction
        if config.training.padding_free:
            check_packed_attention(placement.module)
        self.update_settings = UpdateSettings(
            algorithm=config.algorithm,
            micro_batch_size=config.training.per_device_train_batch_size,
            temperature=config.generation.sampling.temperature,
            max_completion_length=config.generation.max_completion_length,
            max_grad_norm=config.training.max_grad_norm,
            padding_free=config.training.padding_free,
            max_tokens_per_micro_batch=config.training.max_tokens_per_micro_batch,
            sampling_correction=correction
            if _corrects(correction.vllm_importance_sampling_correction, copies_weights)
            else None,
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
        """Run to `total_steps`, logging and checkpointing; returns each step's metrics."""
        history = []
        training = self.config.training
        streaks = RewardFailureStreaks(self.reward_names, self.config.rewards.max_consecutive_reward_failures)
        evaluation = self.config.eval
        try:
            if self.evaluator is not None and evaluation.eval_on_start and self.step_count == 0:
                start_metrics = self.evaluate()
                if metrics_logger is not None:
                    metrics_logger.log(0, start_metrics)
            while self.step_count < self.total_steps:
                try:
                    metrics = self.step(metrics_logger)
                except NonFiniteLogits as error:
                    if self.config.health.health_nonfinite == "off":
                        raise
                    step = self.step_count + 1
                    self._act_on_health([Finding("nonfinite", step, self.step_count, str(error), "stop")])
                except ServerError as error:  # past its retries; this step changed nothing yet
                    saved = self.save() if self.step_count else "none (no step was taken)"
                    raise RunStopped(server_failure_message(error, self.step_count + 1, saved)) from None
                if self.sync_failure is not None:
                    retries, failure, self.sync_failure = (
                        self.config.sync.weight_sync_retries,
                        self.sync_failure,
                        None,
                    )
                    raise RunStopped(
                        sync_failure_message(failure, self.step_count, retries, self.save())
                    ) from None
                evaluated = self.evaluator is not None and evaluation.due(
                    self.step_count, self.total_steps, self.config.log.logging_steps
                )
                if evaluated:
                    metrics.update(self.evaluate())
                history.append(metrics)
                if metrics_logger is not None:
                    if self.step_count % self.config.log.logging_steps == 0 or evaluated:
                        metrics_logger.log(self.step_count, metrics)
                    metrics_logger.advance(self.step_count, metrics)
                self._act_on_health(self.health.update(self.step_count, metrics))
                failing = streaks.update(
                    {name for name in self.reward_names if metrics[f"rewards/{name}/failed_all"] == 1.0}
                )
                if failing is not None:
                    saved = self.save()
                    raise RunStopped(
                        reward_failure_message(
                            failing, streaks.limit, self.step_count, saved, self.last_reward_errors
                        )
                    )
                saved = None
                if self.step_count % training.save_steps == 0 or self.step_count == self.total_steps:
                    saved = self.save()
                if evaluated and evaluation.metric_for_best_model is not None:
                    self._keep_if_best(metrics, saved)
        finally:
            if self.prefetcher is not None:
                self.prefetcher.close()
        return history

    def evaluate(self) -> dict[str, float]:
        """Evaluate the current policy on the eval prompts (`eval/...` metrics, global)."""
        if self.evaluator is None:
            raise ValueError("this run has no eval_dataset to evaluate on")
        if self.prefetcher is not None:
            self.prefetcher.wait()  # the engine is free once the batch generated ahead is done
        self.engine.wake_up()
        with self.placement.rollout_context(self.engine):
            result = self.evaluator(self.engine)
        self.engine.sleep()
        return result.metrics

    def _act_on_health(self, findings: list[Finding]) -> None:
        """Stop the run (after a checkpoint) on the first finding whose action is stop."""
        stop = next((finding for finding in findings if finding.action == "stop"), None)
        if stop is None:
            return
        saved = self.save()
        output_dir = self.config.training.output_dir
        steps = {checkpoint.checkpoint_step(path): path for path in checkpoint.list_checkpoints(output_dir)}
        raise RunStopped(stop_message(stop, saved, steps))

    def _keep_if_best(self, metrics: dict[str, float], saved: Path | None) -> None:
        """Copy this step's checkpoint (saving one if the step saved none) to checkpoint-best when
        its metric_for_best_model beats the best so far."""
        evaluation = self.config.eval
        name = evaluation.metric_for_best_model
        if name not in metrics:
            known = ", ".join(sorted(key for key in metrics if key.startswith("eval/")))
            raise ValueError(f"metric_for_best_model={name!r} is not an eval metric; this run logs: {known}")
        if not evaluation.improves(metrics[name], self.best_metric):
            return
        self.best_metric = metrics[name]
        saved = saved or self.save()
        if self.distributed.is_main:
            checkpoint.keep_as_best(saved, self.config.training.output_dir)
            logger.info(
                "step %d: %s = %.4f is the best so far (checkpoint-best)",
                self.step_count,
                name,
                metrics[name],
            )
        self.distributed.barrier()

    def step(self, metrics_logger: MetricsLogger | None = None) -> dict[str, float]:
        """One generation batch: roll out, score, compute advantages, update, sync."""
        timer = Timer()
        with timer("step"):
            scored, staleness = self._rollout(timer)
            self.last_reward_errors = scored.errors
            batch = collate(scored.groups, self.tokenizer.pad_token_id, self.device)
            if self.prefetcher is not None and self.step_count + 1 < self.total_steps:
                self._launch_prefetch()
            # One row per completion of the global batch, rank after rank.
            all_rewards = self.distributed.all_gather(scored.rewards)
            all_lengths = self.distributed.all_gather(length_columns(batch))
            if self.config.algorithm.mask_truncated_completions:
                batch.loss_mask = overlong_mask(batch.loss_mask, batch.truncated)
            all_kl = None
            if self.config.algorithm.kl_in_reward and self.ref_placement is not None:
                with timer("reward_kl"):
                    kl = reward_kl(
                        self.placement, self.ref_placement, batch, self.update_settings, self.distributed
                    )
                    all_kl = self.distributed.all_gather(kl)
            advantages, reward_metrics = self._advantages(all_rewards, scored, all_kl)
            settings = self.update_settings
            if not (scored.sampling_logprobs and all(group.sampling_logprobs for group in scored.groups)):
                settings = dataclasses.replace(settings, sampling_correction=None, sampling_logprobs=False)
            with timer("update"):
                update_metrics = update_policy(
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
            if self.prefetcher is not None:
                with timer("rollout_wait"):
                    self.prefetcher.wait()  # weights never change under a running generation
            syncs = (self.step_count + 1) % self.config.sync.weight_sync_interval == 0
            with timer("sync"):
                if syncs:
                    version = self.step_count + 1
                    self.sync_failure = sync_with_retries(
                        lambda: self.engine.update_weights(
                            self.placement.rollout_weights(self.engine), version
                        ),
                        self.config.sync.weight_sync_retries,
                        version,
                    )
            check_metrics = {}
            if self.sync_check is not None and syncs:
                with timer("sync_check"):
                    check_metrics = self.sync_check(self.engine, self.placement, step=self.step_count + 1)
        self.step_count += 1
        self.num_tokens += int(all_lengths[:, 3].sum() + all_lengths[:, 2].sum())
        metrics = self.distributed.reduce_metrics(
            {
                **update_metrics,
                **check_metrics,
                **rank_metrics(
                    scored,
                    batch,
                    timer,
                    self.reward_names,
                    self.device,
                    self.rollout.last_metrics if self.batches is None else {},
                ),
            }
        )
        metrics.update({name: float(value) for name, value in reward_metrics.items()})
        metrics.update(batch_metrics(all_rewards, all_lengths, self.reward_names))
        metrics["num_tokens"] = float(self.num_tokens)
        metrics["learning_rate"] = self.scheduler.get_last_lr()[0]
        metrics["dynamic_sample/rounds"] = float(scored.rounds)
        if self.prefetcher is not None:
            metrics["async/staleness"] = float(staleness)
        if self.config.log.log_completions:
            rows = self.distributed.gather_objects(
                completion_rows(scored.groups, scored.rewards, advantages, self.reward_names)
            )
            if metrics_logger is not None and rows is not None:
                metrics_logger.log_completions(self.step_count, [row for part in rows for row in part])
        return metrics

    def _rollout(self, timer: Timer) -> tuple[ScoredGroups, int]:
        """This step's scored groups, prefetched or generated now, and their staleness: policy
        versions between the weights that sampled them and the policy they update."""
        if self.batches is not None:
            self.batches.policy_version = self.step_count
            with timer("rollout_wait"):
                try:
                    return self.batches.next(), 0
                except TimeoutError as error:
                    saved = self.save() if self.step_count else "none (no step was taken)"
                    raise RunStopped(
                        f"stopped before step {self.step_count + 1}: {error}. Checkpoint: {saved}; "
                        "resume with --resume_from_checkpoint latest"
                    ) from None
        if self.prefetcher is not None and self.prefetcher.pending:
            with timer("rollout_wait"):
                prefetched = self.prefetcher.take()
            staleness = self.step_count - min(
                c.policy_version for group in prefetched.value.groups for c in group.completions
            )
            if staleness <= self.config.off_policy.max_staleness:
                for phase, seconds in prefetched.seconds.items():
                    timer.seconds[phase] += seconds
                return prefetched.value, staleness
            logger.warning(
                "step %d: the prefetched batch is %d policy versions old (max_staleness %d); "
                "generating a new one",
                self.step_count,
                staleness,
                self.config.off_policy.max_staleness,
            )
        self.engine.wake_up()
        with self.placement.rollout_context(self.engine):
            scored = self.rollout_and_score(timer)
        self.engine.sleep()
        return scored, self.step_count - self.engine.policy_version

    def _launch_prefetch(self) -> None:
        """Start generating the next step's batch in the background."""

        def produce() -> tuple[ScoredGroups, dict[str, float]]:
            timer = Timer(synchronize=False)
            return self.rollout_and_score(timer), dict(timer.seconds)

        assert self.prefetcher is not None
        self.prefetcher.launch(produce, self._sampling_state())

    def _sampling_state(self) -> dict:
        return self.draws.state_dict()

    def _advantages(
        self, all_rewards: torch.Tensor, scored: ScoredGroups, all_kl: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's advantages (batch,) and the reward metrics, from the rewards of the global
        batch (global_batch, num_rewards); `scored` is this rank's share (groups of other sizes
        than num_generations come from one process). `all_kl`: each completion's KL to the
        reference (global_batch,), subtracted times beta from its reward (kl_in_reward)."""
        sizes = scored.group_sizes or self.config.generation.num_generations
        advantages, metrics = batch_advantages(
            self.config.algorithm,
            self.estimate_advantages,
            all_rewards,
            self.reward_weights.to(all_rewards.device),
            sizes,
            all_kl,
        )
        size, rank = len(all_rewards) // self.distributed.world_size, self.distributed.rank
        advantages = advantages[rank * size : (rank + 1) * size]
        if scored.zero_advantage is not None:
            advantages = advantages.masked_fill(scored.zero_advantage.to(advantages.device), 0.0)
        return advantages, metrics

    def rollout_and_score(self, timer: Timer) -> ScoredGroups:
        """Generate and score; under dynamic_sample, resample prompts to replace groups whose
        rewards have zero spread, up to max_resample_times rounds.

        Over several ranks, each resampling round every rank takes the largest number of prompts
        any rank still lacks (so all ranks run the same rounds and walk the prompt order together);
        a rank that lacks fewer generates only those and skips the rest of its share. A rank that
        lacks none still calls the engine, with no prompts: ranks sharing an engine (colocated
        vLLM with tensor parallelism) generate together.
        """
        algorithm, g = self.config.algorithm, self.config.generation.num_generations
        rounds = 1 + (algorithm.max_resample_times if algorithm.dynamic_sample else 0)
        kept: list[ScoredGroups] = []
        spare: list[ScoredGroups] = []
        errors: list = []
        failed: frozenset[str] | None = None
        rounds_run = 0
        for round_index in range(rounds):
            missing = self.num_prompts - sum(len(part.groups) for part in kept)
            share = missing if round_index == 0 else self.distributed.max_int(missing)
            if share == 0:
                break
            rounds_run += 1
            indices, seeds = self.draws.take(share)
            items = [self.items[index] for index in indices[:missing]]
            with timer("rollout"):
                sampling = self.draws.sampling_for(seeds[:missing])
                groups = self.rollout(self.engine, items, sampling)
            if missing == 0:
                continue
            with timer("reward"):
                result = self.rewards.score(*reward_inputs(groups))
            failed = result.failed_everywhere if failed is None else failed & result.failed_everywhere
            values = result.training_values
            values[[c.finish_reason == "error" for g in groups for c in g.completions]] = float("nan")
            scored = ScoredGroups(groups, values, list(result.errors), round_index + 1, failed)
            if not algorithm.dynamic_sample:
                return scored
            errors.extend(scored.errors)
            flat = combine_rewards(scored.rewards, self.reward_weights)
            flat_mask = zero_std_groups(flat, g)
            kept.append(subset_groups(scored, ~flat_mask, g))
            spare.append(subset_groups(scored, flat_mask, g))
        return merge_groups(kept + spare, self.num_prompts, errors, rounds_run, failed or frozenset())

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
            "best_metric": self.best_metric,
        }

    def load_state_dict(self, state: dict) -> None:
        self.step_count, self.num_tokens = state["step"], state["num_tokens"]
        self.best_metric = state.get("best_metric")
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
        state = self.state_dict()
        per_rank = self.distributed.gather_objects(state["rng"])
        weights = self.placement.full_state_dict()  # every rank takes part in gathering FSDP's shards
        path = Path(training.output_dir) / f"checkpoint-{self.step_count}"
        if self.distributed.is_main:
            path = checkpoint.save_checkpoint(
                training.output_dir,
                self.step_count,
                model=self.model,
                tokenizer=self.tokenizer,
                trainer_state={**state, "rng_per_rank": per_rank},
                save_total_limit=training.save_total_limit,
                state_dict=weights,
                run_id=self.run_id,
            )
        self.distributed.barrier()
        return path


def _corrects(setting: bool | None, copies_weights: bool) -> bool:
    """Whether the importance-sampling correction applies: as set, else for engines with a copy."""
    return copies_weights if setting is None else setting
