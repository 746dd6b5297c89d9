"""The GRPO loop: sample prompts, roll out, score, compute advantages, update, sync, log.

The trainer receives its parts (model, engine, rewards, prompts, logger) ready-made; `launch.py`
builds them from a config. One `step` is one generation batch and `num_iterations` optimizer
steps on it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpoflow import checkpoint
from grpoflow.adapters import merged_adapters, rollout_weights
from grpoflow.algo import combine_rewards, group_advantages, overlong_mask, zero_std_groups
from grpoflow.config import GRPOConfig
from grpoflow.data import PromptItem, PromptSampler
from grpoflow.engines import RolloutEngine, SamplingParams
from grpoflow.metrics import MetricsLogger
from grpoflow.rewards import RewardRunner
from grpoflow.rollout import Group, collate, generate_groups, reward_inputs
from grpoflow.update import UpdateSettings, update_policy

logger = logging.getLogger("grpoflow")


@dataclass(slots=True)
class ScoredGroups:
    """Groups of completions and their rewards, (num_groups * G, num_rewards) with NaN missing."""

    groups: list[Group]
    rewards: torch.Tensor
    errors: list = field(default_factory=list)
    rounds: int = 1


class Timer:
    """Wall-clock seconds per phase of a step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start


class GRPOTrainer:
    """Runs GRPO on prompts with a rollout engine and reward functions."""

    def __init__(
        self,
        config: GRPOConfig,
        *,
        model: torch.nn.Module,
        tokenizer,
        engine: RolloutEngine,
        rewards: RewardRunner,
        items: list[PromptItem],
        optimizer: torch.optim.Optimizer,
        scheduler,
        ref_model: torch.nn.Module | None = None,
    ) -> None:
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.engine, self.rewards, self.items = engine, rewards, items
        self.optimizer, self.scheduler, self.ref_model = optimizer, scheduler, ref_model
        self.device = next(model.parameters()).device
        self.sampler = PromptSampler(
            len(items), seed=config.training.seed, shuffle=config.data.dataset_shuffle
        )
        self.num_prompts = config.generation_batch_size // config.generation.num_generations
        self.total_steps = config.total_steps(len(items))
        self.step_count = 0
        self.num_tokens = 0
        self.sampling = self._sampling_params()
        self.update_settings = UpdateSettings(
            algorithm=config.algorithm,
            micro_batch_size=config.training.per_device_train_batch_size,
            temperature=config.generation.temperature,
            max_completion_length=config.generation.max_completion_length,
            max_grad_norm=config.training.max_grad_norm,
        )

    def _sampling_params(self) -> SamplingParams:
        generation = self.config.generation
        eos = self.tokenizer.eos_token_id
        return SamplingParams(
            n=generation.num_generations,
            max_tokens=generation.max_completion_length,
            temperature=generation.temperature,
            top_p=generation.top_p,
            top_k=generation.top_k,
            min_p=generation.min_p,
            repetition_penalty=generation.repetition_penalty,
            stop_token_ids=[eos] if eos is not None else [],
            stop=list(generation.stop),
        )

    def train(self, metrics_logger: MetricsLogger | None = None) -> list[dict[str, float]]:
        """Run to `total_steps`, logging and checkpointing; returns each step's metrics."""
        history = []
        training = self.config.training
        while self.step_count < self.total_steps:
            metrics = self.step(metrics_logger)
            history.append(metrics)
            if metrics_logger is not None:
                if self.step_count % self.config.log.logging_steps == 0:
                    metrics_logger.log(self.step_count, metrics)
                metrics_logger.advance(self.step_count, metrics)
            if self.step_count % training.save_steps == 0 or self.step_count == self.total_steps:
                self.save()
        return history

    def step(self, metrics_logger: MetricsLogger | None = None) -> dict[str, float]:
        """One generation batch: roll out, score, compute advantages, update, sync."""
        timer = Timer()
        with timer("step"):
            self.engine.wake_up()
            with merged_adapters(self.model):
                scored = self.rollout_and_score(timer)
            self.engine.sleep()
            rewards = combine_rewards(scored.rewards, self.rewards.weights.to(scored.rewards.device))
            advantages, reward_metrics = group_advantages(
                rewards, self.config.generation.num_generations, self.config.algorithm.scale_rewards
            )
            batch = collate(scored.groups, self.tokenizer.pad_token_id, self.device)
            if self.config.algorithm.mask_truncated_completions:
                batch.completion_mask = overlong_mask(batch.completion_mask, batch.truncated)
            with timer("update"):
                update_metrics = update_policy(
                    self.model,
                    self.optimizer,
                    self.scheduler,
                    batch,
                    advantages.to(self.device),
                    self.update_settings,
                    self.ref_model,
                )
            with timer("sync"):
                self.engine.update_weights(rollout_weights(self.model, self.engine), self.step_count + 1)
        self.step_count += 1
        self.num_tokens += int(batch.completion_mask.sum() + batch.prompt_mask.sum())
        metrics = {**reward_metrics, **update_metrics}
        metrics.update(self._rollout_metrics(scored, batch, timer))
        if metrics_logger is not None and self.config.log.log_completions:
            metrics_logger.log_completions(self.step_count, self._completion_rows(scored, advantages))
        return metrics

    def rollout_and_score(self, timer: Timer) -> ScoredGroups:
        """Generate and score; under dynamic_sample, resample prompts to replace groups whose
        rewards have zero spread, up to max_resample_times rounds."""
        algorithm, g = self.config.algorithm, self.config.generation.num_generations
        rounds = 1 + (algorithm.max_resample_times if algorithm.dynamic_sample else 0)
        kept: list[ScoredGroups] = []
        spare: list[ScoredGroups] = []
        for round_index in range(rounds):
            missing = self.num_prompts - sum(len(part.groups) for part in kept)
            items = [self.items[index] for index in self.sampler.take(missing)]
            with timer("rollout"):
                groups = generate_groups(self.engine, self.tokenizer, items, self.sampling)
            with timer("reward"):
                result = self.rewards.score(*reward_inputs(groups))
            scored = ScoredGroups(groups, result.values, list(result.errors), round_index + 1)
            if not algorithm.dynamic_sample:
                return scored
            flat = combine_rewards(scored.rewards, self.rewards.weights)
            flat_mask = zero_std_groups(flat, g)
            kept.append(_subset(scored, ~flat_mask, g))
            spare.append(_subset(scored, flat_mask, g))
            if sum(len(part.groups) for part in kept) >= self.num_prompts:
                break
        merged = _merge(kept + spare, self.num_prompts)
        merged.rounds = round_index + 1
        return merged

    def _rollout_metrics(self, scored: ScoredGroups, batch, timer: Timer) -> dict[str, float]:
        lengths = batch.completion_mask.sum(1).float()
        terminated = lengths[~batch.truncated]
        rollout_seconds = max(timer.seconds["rollout"], 1e-9)
        metrics = {
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": batch.truncated.float().mean().item(),
            "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else 0.0,
            "num_tokens": float(self.num_tokens),
            "learning_rate": self.scheduler.get_last_lr()[0],
            "rewards/num_errors": float(len(scored.errors)),
            "dynamic_sample/rounds": float(scored.rounds),
            "tokens_per_second/rollout": lengths.sum().item() / rollout_seconds,
        }
        for index, name in enumerate(self.rewards.names):
            column = scored.rewards[:, index]
            valid = column[~column.isnan()]
            metrics[f"rewards/{name}/mean"] = valid.mean().item() if len(valid) else float("nan")
            metrics[f"rewards/{name}/std"] = valid.std().item() if len(valid) > 1 else 0.0
        if self.device.type == "cuda":
            metrics["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        for phase, seconds in timer.seconds.items():
            metrics[f"time/{phase}"] = seconds
        return metrics

    def _completion_rows(self, scored: ScoredGroups, advantages: torch.Tensor) -> list[dict]:
        prompts, completions, _, _ = reward_inputs(scored.groups)
        rows = []
        for index, (prompt, completion) in enumerate(zip(prompts, completions)):
            values = scored.rewards[index].tolist()
            rows.append(
                {
                    "prompt": prompt,
                    "completion": completion,
                    "rewards": {
                        name: None if math.isnan(v) else v for name, v in zip(self.rewards.names, values)
                    },
                    "advantage": float(advantages[index]),
                }
            )
        return rows

    def state_dict(self) -> dict:
        return {
            "step": self.step_count,
            "num_tokens": self.num_tokens,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": checkpoint.rng_state(),
            "config": self.config.to_flat_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step_count, self.num_tokens = state["step"], state["num_tokens"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state["rng"])
        self.engine.update_weights(rollout_weights(self.model, self.engine), self.step_count)

    def save(self) -> Path:
        training = self.config.training
        return checkpoint.save_checkpoint(
            training.output_dir,
            self.step_count,
            model=self.model,
            tokenizer=self.tokenizer,
            trainer_state=self.state_dict(),
            save_total_limit=training.save_total_limit,
        )


def _subset(scored: ScoredGroups, keep: torch.Tensor, num_generations: int) -> ScoredGroups:
    """The groups where `keep` (num_groups,) is true, with their reward rows."""
    indices = keep.nonzero().flatten().tolist()
    rows = torch.tensor(
        [i * num_generations + j for i in indices for j in range(num_generations)], dtype=torch.long
    )
    return ScoredGroups(
        [scored.groups[i] for i in indices],
        scored.rewards[rows] if len(rows) else scored.rewards[:0],
        scored.errors,
        scored.rounds,
    )


def _merge(parts: list[ScoredGroups], num_groups: int) -> ScoredGroups:
    """The first `num_groups` groups over `parts`, in order."""
    groups = [group for part in parts for group in part.groups][:num_groups]
    size = sum(len(group.completions) for group in groups)
    rewards = torch.cat([part.rewards for part in parts])[:size]
    errors = [error for part in {id(p.errors): p for p in parts}.values() for error in part.errors]
    return ScoredGroups(groups, rewards, errors)
