"""Evaluation during training and its statistics, on the embedded tiny model (CPU)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from helpers.support import recipe

from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion, SamplingParams
from grpoflow.rewards import RewardRunner
from grpoflow.rewards.params import RewardConfig
from grpoflow.rollout.groups import Group
from grpoflow.run.build import run
from grpoflow.run.checkpoint import BEST, load_trainer_state
from grpoflow.run.evaluation import EvalConfig, Evaluator

EVAL = {
    "eval_dataset": ["echo#12"],
    "eval_strategy": "steps",
    "eval_steps": 2,
    "num_generations_eval": 4,
    "eval_pass_threshold": 0.25,
}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_evaluating_leaves_the_training_steps_unchanged(tmp_path):
    plain = run(recipe(tmp_path / "plain", max_steps=4))
    evaluated = run(recipe(tmp_path / "evaluated", max_steps=4, eval_on_start=True, **EVAL))
    for before, after in zip(plain, evaluated, strict=True):
        for key in ("reward", "loss", "grad_norm", "completions/mean_length"):
            assert before[key] == after[key], key
    logged = read_jsonl(tmp_path / "evaluated" / "run" / "metrics.jsonl")
    evaluations = {row["step"]: row for row in logged if "eval/reward" in row}
    assert sorted(evaluations) == [0, 2, 4]
    metrics = evaluations[4]
    for key in ("eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/avg@4", "eval/rewards/echo/mean"):
        assert 0.0 <= metrics[key] <= 1.0, key
    assert metrics["eval/pass@1"] == pytest.approx(metrics["eval/avg@4"])
    assert metrics["eval/pass@1"] <= metrics["eval/pass@2"] <= metrics["eval/pass@4"]
    assert metrics["eval/num_prompts"] == 12
    assert "eval/maj@1" not in metrics  # the echo reward extracts no answer
    # The same prompts and seeds each time: the start's evaluation is the untrained policy's.
    assert evaluations[0]["eval/completions/mean_length"] > 0


@pytest.mark.slow
def test_checkpoint_best_follows_the_metric(tmp_path):
    config = recipe(
        tmp_path,
        max_steps=6,
        save_steps=1000,
        save_total_limit=1,
        metric_for_best_model="reward",
        **{**EVAL, "eval_steps": 1, "eval_temperature": 1.5},
    )
    history = run(config)
    rewards = [step["eval/reward"] for step in history]
    best_step = rewards.index(max(rewards)) + 1
    state = load_trainer_state(tmp_path / "run" / BEST)
    assert state["step"] == best_step
    assert state["best_metric"] == max(rewards)
    # Rotation keeps its limit of one numbered checkpoint beside the best.
    numbered = sorted(path.name for path in (tmp_path / "run").glob("checkpoint-[0-9]*"))
    assert numbered == ["checkpoint-6"]


class Scripted:
    """A Rollout that answers each prompt with the completions written for it."""

    last_metrics: dict[str, float] = {}

    def __init__(self, texts: dict[str, list[str]]) -> None:
        self.texts = texts

    def __call__(self, engine, items: Sequence[PromptItem], params) -> list[Group]:
        groups = []
        for item in items:
            texts = self.texts[item.prompt]
            completions = [
                Completion(token_ids=[1] * len(text), logprobs=[0.0] * len(text), finish_reason="stop")
                for text in texts
            ]
            groups.append(Group(item=item, completions=completions, texts=texts))
        return groups


def test_majority_voting_reads_the_math_answers():
    pytest.importorskip("math_verify")
    texts = {
        "q1": ["#### 5", "#### 7", "#### 7", "#### 5"],  # gold 5: one vote each at k=2, 5 first
        "q2": ["#### 3", "#### 4", "#### 4", "no answer"],  # gold 3: 4 wins at k=4
    }
    items = [
        PromptItem(prompt="q1", prompt_ids=[1], columns={"solution": "5"}),
        PromptItem(prompt="q2", prompt_ids=[1], columns={"solution": "3"}),
    ]
    rewards = RewardRunner.from_config(RewardConfig(reward_funcs=["accuracy"], reward_num_workers=0))
    with rewards:
        evaluator = Evaluator(
            EvalConfig(num_generations_eval=4),
            items,
            rollout=Scripted(texts),
            rewards=rewards,
            sampling=SamplingParams(n=4),
            batch_size=8,
        )
        metrics = evaluator(engine=None).metrics
    assert metrics["eval/pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert metrics["eval/pass@4"] == 1.0
    assert metrics["eval/maj@1"] == pytest.approx((1 + 1) / 2)
    assert metrics["eval/maj@2"] == pytest.approx((1 + 1) / 2)
    assert metrics["eval/maj@4"] == pytest.approx((1 + 0) / 2)
