"""A user's rollout function (TRL's `rollout_func`): a TRL-style function training on the tiny
model through `generate_rollout_completions`, the checks on its output, env_mask, extra keys and
missing log-probs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.support import read_jsonl, recipe

from grpoflow.agents import RolloutTrainer, generate_rollout_completions
from grpoflow.algo.losses import LossSettings, policy_loss
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion, EngineCapabilities, EngineStats, SamplingParams
from grpoflow.policy.tiny import build_char_tokenizer
from grpoflow.rollout.batch import collate
from grpoflow.rollout.groups import reward_inputs
from grpoflow.rollout.rollout_func import RolloutFunction, check_rollout_output
from grpoflow.run.build import run

# Written as TRL's OpenEnv documentation writes a rollout function (only the import differs).
TRL_STYLE = """
from grpoflow.agents import generate_rollout_completions


def rollout_func(prompts, trainer):
    outputs = generate_rollout_completions(trainer, prompts)
    tokenizer = trainer.processing_class
    completions_text = [tokenizer.decode(out["completion_ids"], skip_special_tokens=True) for out in outputs]
    env_rewards = [text[:8].count(prompt[-2]) / 8 for text, prompt in zip(completions_text, prompts)]
    return {
        "prompt_ids": [out["prompt_ids"] for out in outputs],
        "completion_ids": [out["completion_ids"] for out in outputs],
        "logprobs": [out["logprobs"] for out in outputs],
        "env_reward": env_rewards,
        "num_generations_seen": trainer.args.num_generations,
    }


def without_logprobs(prompts, trainer):
    output = rollout_func(prompts, trainer)
    del output["logprobs"]
    return output


def reward_from_env(completions, **kwargs):
    assert all(n == 8 for n in kwargs["num_generations_seen"])
    return [float(reward) for reward in kwargs.get("env_reward", [])]
"""


def write_functions(tmp_path):
    path = tmp_path / "rollout.py"
    path.write_text(TRL_STYLE)
    return path


@pytest.mark.slow
def test_a_trl_style_rollout_func_trains_with_the_generation_helper(tmp_path):
    path = write_functions(tmp_path)
    config = recipe(
        tmp_path,
        max_steps=2,
        rollout_func=f"{path}:rollout_func",
        reward_funcs=[f"{path}:reward_from_env"],
        log_completions=True,
    )
    history = run(config)
    assert len(history) == 2
    assert "rewards/reward_from_env/mean" in history[-1]
    assert "sampling/sampling_logp_difference/mean" in history[-1]  # the engine's log-probs arrived
    row = read_jsonl(tmp_path / "run" / "completions.jsonl")[0]
    letter = row["prompt"][-2]
    assert row["rewards"]["reward_from_env"] == row["completion"][:8].count(letter) / 8


@pytest.mark.slow
def test_without_logprobs_the_correction_and_the_gap_are_off_for_the_batch(tmp_path):
    path = write_functions(tmp_path)
    config = recipe(
        tmp_path,
        max_steps=1,
        rollout_func=f"{path}:without_logprobs",
        reward_funcs=[f"{path}:reward_from_env"],
        vllm_importance_sampling_correction=True,
    )
    (step,) = run(config)
    assert not [name for name in step if name.startswith("sampling/")]
    assert step["loss"] == step["loss"]  # trained all the same


def tokenizer():
    return build_char_tokenizer()


def output(**changes):
    values = {
        "prompt_ids": [[5, 6], [5, 6]],
        "completion_ids": [[7, 8, 9], [7]],
        "logprobs": [[-0.1, -0.2, -0.3], [-0.5]],
    }
    return {**values, **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"completion_ids": None}, "lacks \\['completion_ids'\\]"),
        (
            {"prompt_ids": [[5, 6]]},
            "1 rows of 'prompt_ids'; it was given 2 prompts \\(1 x num_generations 2\\)",
        ),
        ({"completion_ids": [[7, 8, 9], [10_000]]}, "holds 10000, not a token id in \\[0, "),
        ({"completion_ids": [[7, 8, 9], ["a"]]}, "holds 'a', not a token id"),
        ({"prompt_ids": [[5, 6], []]}, "prompt_ids row 1 is empty"),
        ({"logprobs": [[-0.1], [-0.5]]}, "'logprobs' row 0 has 1 values for 3 completion tokens"),
        ({"logprobs": [[-0.1, float("nan"), -0.3], [-0.5]]}, "not a finite log-prob"),
        ({"env_mask": [[1, 2, 1], [1]]}, "'env_mask' row 0: 2 is not 0"),
        ({"completions": ["x", "y"]}, "'completions' is a reward function argument"),
        ({"env_reward": [1.0]}, "1 rows of 'env_reward'"),
    ],
)
def test_bad_outputs_are_named_with_the_fix(changes, message):
    given = output(**changes)
    if changes.get("completion_ids", 0) is None:
        del given["completion_ids"]
    with pytest.raises(ValueError, match=message):
        check_rollout_output(given, 2, len(tokenizer()), 2)
    with pytest.raises(TypeError, match="must return a dict"):
        check_rollout_output([given], 2, len(tokenizer()), 2)


def test_extra_keys_reach_the_reward_inputs_per_completion_and_override_the_row():
    item = PromptItem("echo a:", [5, 6], {"letter": "a", "score": "row"})
    function = RolloutFunction(
        lambda prompts, trainer: output(score=[0.5, 1.5], tag="same"), tokenizer(), None
    )
    groups = function(FixedEngine(), [item], SamplingParams(n=2))
    _, _, _, columns = reward_inputs(groups)
    assert columns == {"letter": ["a", "a"], "score": [0.5, 1.5], "tag": ["same", "same"]}


def test_env_mask_tokens_get_no_gradient_and_no_kl():
    item = PromptItem("echo a:", [5, 6], {})
    masked = output(env_mask=[[1, 0, 1], [1]])
    groups = RolloutFunction(lambda prompts, trainer: masked, tokenizer(), None)(
        FixedEngine(), [item], SamplingParams(n=2)
    )
    batch = collate(groups, 0, torch.device("cpu"))
    assert batch.loss_mask.tolist() == [[1, 0, 1], [1, 0, 0]]
    assert batch.sampling_logps[0, 1] == 0.0  # an environment token carries no sampling log-prob
    logps = torch.full((2, 3), -1.0, requires_grad=True)
    loss, _ = policy_loss(
        logps,
        None,
        torch.tensor([1.0, -1.0]),
        batch.loss_mask,
        LossSettings(beta=0.1),
        ref_logps=torch.full((2, 3), -2.0),
    )
    loss.backward()
    assert logps.grad[0, 1] == 0 and logps.grad[0, 0] != 0 and logps.grad[0, 2] != 0


def test_rows_with_different_prompts_share_the_common_prefix_and_mask_the_rest():
    item = PromptItem("echo a:", [5, 6], {})
    given = output(prompt_ids=[[5, 6, 11], [5, 6]], completion_ids=[[7], [8]], logprobs=[[-0.1], [-0.2]])
    (group,) = RolloutFunction(lambda prompts, trainer: given, tokenizer(), None)(
        FixedEngine(), [item], SamplingParams(n=2)
    )
    assert group.item.prompt_ids == [5, 6]
    assert [c.token_ids for c in group.completions] == [[11, 7], [8]]
    assert [c.loss_mask for c in group.completions] == [[0, 1], [1]]
    assert group.sampling_logprobs


def test_a_rank_without_prompts_still_calls_the_engine_and_not_the_function():
    engine = FixedEngine()
    function = RolloutFunction(
        lambda prompts, trainer: pytest.fail("called without prompts"), tokenizer(), None
    )
    assert function(engine, [], []) == [] and engine.calls == [[]]


def test_the_helper_samples_one_completion_per_prompt_with_the_runs_settings():
    engine = FixedEngine()
    trainer = RolloutTrainer(
        processing_class=tokenizer(),
        args=SimpleNamespace(num_generations=2),
        engine=engine,
        sampling=SamplingParams(max_tokens=3, temperature=0.7),
        num_generations=2,
        per_prompt_params=True,
        seed=11,
    )
    results = generate_rollout_completions(trainer, ["ab", "cd"], generation_overrides={"temperature": 0.5})
    assert [sorted(result) for result in results] == [
        ["completion_ids", "logprobs", "prompt_ids", "text"]
    ] * 2
    assert results[0]["prompt_ids"] == tokenizer()("ab")["input_ids"]
    assert results[0]["completion_ids"] == [7, 8, 9] and results[0]["logprobs"] == [-0.1, -0.2, -0.3]
    params = engine.calls[0]
    assert [p.temperature for p in params] == [0.5, 0.5] and len({p.seed for p in params}) == 2
    assert trainer.max_completion_length == 3 and trainer.state.global_step == 3
    with pytest.raises(ValueError, match="n must be 1"):
        generate_rollout_completions(trainer, ["ab"], generation_overrides={"n": 2})
    with pytest.raises(ValueError, match="\\['beam_width'\\] are not sampling settings"):
        generate_rollout_completions(trainer, ["ab"], generation_overrides={"beam_width": 2})


class FixedEngine:
    """An engine answering every prompt with the same completion (ids 7, 8, 9)."""

    capabilities = EngineCapabilities(name="fixed")
    shares_policy_weights, policy_version, stats = True, 3, EngineStats()

    def __init__(self) -> None:
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append(params)
        return [[Completion([7, 8, 9], [-0.1, -0.2, -0.3], "length", 3)] for _ in prompts]
