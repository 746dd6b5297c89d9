"""Evaluation on held-out prompts: n samples per prompt with the run's engine and rewards, reported
as the mean of each reward, pass@k, avg@n, maj@k and completion lengths (`eval/...` metrics).

The same prompts are sampled with the same seeds at every evaluation (seeds come from
`eval_seed`, never from the training stream), so two evaluations differ only by the policy, and a
run with evaluation takes exactly the training steps a run without it takes. A sample is correct
when the reward `eval_pass_reward` (default: the first reward function) gives it at least
`eval_pass_threshold`; maj@k votes with the answers that reward extracts (`extract_answer`, which
the `accuracy` reward has), and is left out for rewards that extract none.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from grpoflow.algo import combine_rewards
from grpoflow.algo.pass_at_k import k_values, majority_correct, pass_at_k
from grpoflow.data.prompts import PromptItem
from grpoflow.distributed import DistributedContext
from grpoflow.engines import RolloutEngine, SamplingParams
from grpoflow.options import require
from grpoflow.rewards import RewardRunner
from grpoflow.rollout.groups import Group, Rollout, reward_inputs
from grpoflow.run import checkpoint

logger = logging.getLogger("grpoflow")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Held-out prompts, when to evaluate on them, how to sample, and which checkpoint is best
    (TRL's names where TRL has the option)."""

    eval_dataset: list[str] = field(default_factory=list)
    """Datasets to evaluate on, as `dataset` takes them (`gsm8k`, `file.jsonl`, `org/name`,
    `NAME#N`); empty: none."""
    eval_split: str = "test"
    """Split of eval_dataset to read (packaged tasks and hub datasets)."""
    eval_strategy: Literal["no", "steps"] = "no"
    """When to evaluate during training: no, or every eval_steps steps."""
    eval_steps: int | None = None
    """Steps between evaluations; unset: logging_steps."""
    eval_on_start: bool = False
    """Evaluate once before the first training step (a baseline)."""
    num_generations_eval: int | None = None
    """Samples per eval prompt (the n of pass@k); unset: num_generations."""
    per_device_eval_batch_size: int | None = None
    """Completions per engine call during evaluation; unset: the generation batch."""
    eval_temperature: float | None = None
    """Sampling temperature of evaluation (0: greedy); unset: the training temperature."""
    eval_pass_reward: str | None = None
    """The reward that decides whether a sample is correct (pass@k, maj@k); unset: the first."""
    eval_pass_threshold: float = 1.0
    """A sample is correct when eval_pass_reward gives it at least this."""
    eval_seed: int = 1234
    """Seed of evaluation's sampling (the same prompts get the same seeds at every evaluation)."""
    metric_for_best_model: str | None = None
    """An eval metric (`pass@1`, `eval/reward`, ...) whose best value's checkpoint is kept as
    `checkpoint-best` beside the rotating ones; unset: none kept."""
    greater_is_better: bool | None = None
    """Whether a larger metric_for_best_model is better; unset: yes, unless its name ends in
    `loss` or `length`."""

    def __post_init__(self) -> None:
        for name in ("eval_steps", "num_generations_eval", "per_device_eval_batch_size"):
            value = getattr(self, name)
            require(value is None or value >= 1, name, ">= 1 (or unset)", value)
        temperature = self.eval_temperature
        require(temperature is None or temperature >= 0, "eval_temperature", ">= 0 (or unset)", temperature)
        if self.metric_for_best_model is not None and not self.metric_for_best_model.startswith("eval/"):
            self.metric_for_best_model = f"eval/{self.metric_for_best_model}"

    @property
    def during_training(self) -> bool:
        """Whether a training run evaluates (a strategy other than `no`, or eval_on_start)."""
        return bool(self.eval_dataset) and (self.eval_strategy != "no" or self.eval_on_start)

    def best_is_greater(self) -> bool:
        if self.greater_is_better is not None:
            return self.greater_is_better
        return not (self.metric_for_best_model or "").endswith(("loss", "length"))

    def due(self, step: int, total_steps: int, logging_steps: int) -> bool:
        """Whether to evaluate after `step` (eval_steps, else every logging_steps, and at the end)."""
        if self.eval_strategy == "no":
            return False
        every = self.eval_steps or logging_steps
        return step % every == 0 or step == total_steps

    def improves(self, value: float, best: float | None) -> bool:
        """Whether metric value `value` beats `best` (None: nothing yet)."""
        if best is None:
            return True
        return value > best if self.best_is_greater() else value < best

    def new_best(self, metrics: dict[str, float], best: float | None) -> float | None:
        """metric_for_best_model's value in `metrics` when it beats `best`, else None; a
        ValueError naming the logged eval metrics when the run does not log it."""
        name = self.metric_for_best_model
        if name not in metrics:
            known = ", ".join(sorted(key for key in metrics if key.startswith("eval/")))
            raise ValueError(f"metric_for_best_model={name!r} is not an eval metric; this run logs: {known}")
        return metrics[name] if self.improves(metrics[name], best) else None


@dataclass(slots=True)
class BestCheckpoint:
    """The best metric_for_best_model so far, with checkpoint-best a copy of its checkpoint."""

    config: EvalConfig
    output_dir: str | Path
    value: float | None = None
    """The best value so far (None: none yet)."""

    def consider(
        self,
        step: int,
        metrics: dict[str, float],
        saved: Path | None,
        save: Callable[[], Path],
        distributed: DistributedContext,
    ) -> None:
        """Copy step `step`'s checkpoint (`saved`, or one `save()` writes now) to checkpoint-best
        when its metric beats the best so far (a collective: every rank calls it)."""
        best = self.config.new_best(metrics, self.value)
        if best is None:
            return
        self.value = best
        saved = saved or save()
        if distributed.is_main:
            checkpoint.keep_as_best(saved, self.output_dir)
            name = self.config.metric_for_best_model
            logger.info("step %d: %s = %.4f is the best so far (checkpoint-best)", step, name, best)
        distributed.barrier()


@dataclass(slots=True)
class EvalResult:
    """One evaluation: its metrics (global over ranks) and this rank's groups and rewards."""

    metrics: dict[str, float]
    groups: list[Group]
    rewards: torch.Tensor
    """(completions, num_rewards) with NaN where missing."""


class Evaluator:
    """Evaluates a policy through `rollout` on `items` (this rank's share of the eval prompts).

    Args:
        config: the eval section.
        items: every eval prompt (each rank takes items[rank::world_size]).
        rollout: what plays a prompt (single completions or episodes), as in training.
        rewards: the run's reward functions.
        sampling: the training sampling params (n, temperature, stops) evaluation starts from.
        per_prompt_seeds: the engine takes one SamplingParams per prompt.
    """

    def __init__(
        self,
        config: EvalConfig,
        items: Sequence[PromptItem],
        *,
        rollout: Rollout,
        rewards: RewardRunner,
        sampling: SamplingParams,
        distributed: DistributedContext | None = None,
        per_prompt_seeds: bool = False,
        batch_size: int,
    ) -> None:
        self.config, self.rollout, self.rewards = config, rollout, rewards
        self.distributed = distributed or DistributedContext()
        rank, world_size = self.distributed.rank, self.distributed.world_size
        self.items = list(items)[rank::world_size]
        self.indices = list(range(len(items)))[rank::world_size]
        n = config.num_generations_eval or sampling.n
        temperature = sampling.temperature if config.eval_temperature is None else config.eval_temperature
        self.sampling = dataclasses.replace(sampling, n=n, temperature=temperature)
        self.per_prompt_seeds = per_prompt_seeds
        self.prompts_per_call = max(1, (config.per_device_eval_batch_size or batch_size) // n)
        self.pass_reward = config.eval_pass_reward or rewards.names[0]
        if self.pass_reward not in rewards.names:
            raise ValueError(
                f"eval_pass_reward={self.pass_reward!r} is not one of the run's rewards ({', '.join(rewards.names)})"
            )
        function = dict(zip(rewards.names, rewards.funcs))[self.pass_reward]
        self.extract_answer = getattr(function, "extract_answer", None)

    def on(self, items: Sequence[PromptItem]) -> Evaluator:
        """This evaluator (its rollout, rewards and sampling) on other prompts."""
        other = copy.copy(self)
        rank, world_size = self.distributed.rank, self.distributed.world_size
        other.items = list(items)[rank::world_size]
        other.indices = list(range(len(items)))[rank::world_size]
        return other

    def __call__(self, engine: RolloutEngine) -> EvalResult:
        """Sample every eval prompt, score, and reduce to `eval/...` metrics over all ranks."""
        started = time.perf_counter()
        groups: list[Group] = []
        with torch.random.fork_rng(
            devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []
        ):
            for start in range(0, max(len(self.items), 1), self.prompts_per_call):
                items = self.items[start : start + self.prompts_per_call]
                seeds = [self.config.eval_seed + index for index in self.indices[start : start + len(items)]]
                groups.extend(self.rollout(engine, items, self._params(seeds)))
        rewards = self.rewards.score(*reward_inputs(groups)).training_values
        metrics = self._metrics(groups, rewards, time.perf_counter() - started)
        return EvalResult(metrics, groups, rewards)

    def _params(self, seeds: list[int]) -> SamplingParams | list[SamplingParams]:
        if self.per_prompt_seeds:
            return [dataclasses.replace(self.sampling, seed=seed) for seed in seeds]
        return dataclasses.replace(self.sampling, seed=seeds[0] if seeds else self.config.eval_seed)

    def _metrics(self, groups: list[Group], rewards: torch.Tensor, seconds: float) -> dict[str, float]:
        """Sums and counts on this rank, reduced over ranks, then divided."""
        n = self.sampling.n
        names = self.rewards.names
        column = rewards[:, names.index(self.pass_reward)] if len(rewards) else torch.zeros(0)
        correct = (column.nan_to_num(nan=float("-inf")) >= self.config.eval_pass_threshold).view(-1, n)
        combined = combine_rewards(rewards, self.rewards.weights) if len(rewards) else torch.zeros(0)
        lengths = torch.tensor([len(c.token_ids) for g in groups for c in g.completions], dtype=torch.float64)
        truncated = torch.tensor([c.truncated for g in groups for c in g.completions], dtype=torch.float64)
        sums: dict[str, torch.Tensor] = {
            "prompts": torch.tensor(float(len(groups)), dtype=torch.float64),
            "completions": torch.tensor(float(len(lengths)), dtype=torch.float64),
            "reward": combined[~combined.isnan()].double().sum(),
            "reward_count": (~combined.isnan()).double().sum(),
            "completions/mean_length": lengths.sum(),
            "completions/clipped_ratio": truncated.sum(),
            f"avg@{n}": correct.double().sum(),
        }
        for index, name in enumerate(names):
            values = rewards[:, index] if len(rewards) else torch.zeros(0)
            sums[f"rewards/{name}/mean"] = values[~values.isnan()].double().sum()
            sums[f"rewards/{name}/count"] = (~values.isnan()).double().sum()
        for k in k_values(n):
            sums[f"pass@{k}"] = pass_at_k(correct, k).sum()
            if self.extract_answer is not None:
                answers = [
                    [self.extract_answer(text) for text in self._answers_of(group)] for group in groups
                ]
                sums[f"maj@{k}"] = majority_correct(answers, correct, k).sum()
        names_order = list(sums)
        totals = self.distributed.all_reduce(torch.stack([sums[key] for key in names_order]))
        total = dict(zip(names_order, totals.tolist()))
        longest = torch.tensor(float(lengths.max()) if len(lengths) else 0.0)
        longest = float(self.distributed.all_reduce(longest, op="max"))
        prompts, completions = max(total["prompts"], 1), max(total["completions"], 1)
        metrics = {
            "eval/reward": total["reward"] / max(total["reward_count"], 1),
            "eval/completions/mean_length": total["completions/mean_length"] / completions,
            "eval/completions/max_length": longest,
            "eval/completions/clipped_ratio": total["completions/clipped_ratio"] / completions,
            f"eval/avg@{n}": total[f"avg@{n}"] / completions,
            "eval/num_prompts": total["prompts"],
            "eval/tokens_per_second": total["completions/mean_length"] / max(seconds, 1e-9),
            "eval/time": seconds,
        }
        for name in names:
            metrics[f"eval/rewards/{name}/mean"] = total[f"rewards/{name}/mean"] / max(
                total[f"rewards/{name}/count"], 1
            )
        for key in total:
            if key.startswith(("pass@", "maj@")):
                metrics[f"eval/{key}"] = total[key] / prompts
        return metrics

    def _answers_of(self, group: Group) -> list[Any]:
        """What answer extraction reads per completion: its conversation or its text."""
        if group.conversations is not None:
            return [turns or text for turns, text in zip(group.conversations, group.texts)]
        return list(group.texts)
