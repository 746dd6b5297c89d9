"""Sampling on-policy by construction (CPU, float32): an engine whose model differs from the
trainer's only proposes; the completions come out as the trainer's own keyed draws."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.native_fixtures import one_thread, perturbed, tiny  # noqa: F401 (a fixture)
from helpers.support import recipe

from grpoflow.algo import LogprobOptions, sequence_logprobs
from grpoflow.algo.truncation import Truncation
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.policy.placement import Placement
from grpoflow.rollout.batch import collate
from grpoflow.rollout.groups import SingleTurn
from grpoflow.rollout.on_policy import OnPolicySingleTurn, Replay
from grpoflow.run.build import run


class Tokens:
    """A tokenizer of ids: a text is its ids joined."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12]]


def items():
    return [PromptItem(prompt=str(p), prompt_ids=p, columns={}) for p in PROMPTS]


def params(**overrides):
    base = dict(n=4, max_tokens=12, temperature=1.0, stop_token_ids=(1,))
    return [SamplingParams(**{**base, **overrides}, seed=100 + index) for index in range(len(PROMPTS))]


def engine(model):
    return NativeEngine(model, config=NativeEngineConfig(max_num_seqs=16, block_size=4, num_kv_blocks=256))


@pytest.mark.parametrize("sampling", [{}, {"top_p": 0.8, "top_k": 20}])
def test_completions_are_the_trainers_own_draws_whatever_the_engine_proposes(sampling):
    torch.manual_seed(0)
    policy = tiny()
    request = params(**sampling)
    truncation = Truncation(top_k=20, top_p=0.8) if sampling else None
    # What the trainer's own sampler draws: the native engine on the trainer's weights (float32:
    # its kernels agree with the training forward on every draw here).
    gumbel = [dataclasses.replace(one, draw="gumbel") for one in request]
    expected = SingleTurn(Tokens())(engine(policy), items(), gumbel)
    proposer = engine(perturbed(policy, 0.2))  # a different model proposes
    proposed = SingleTurn(Tokens())(proposer, items(), gumbel)
    assert [c.token_ids for g in proposed for c in g.completions] != [
        c.token_ids for g in expected for c in g.completions
    ]
    rollout = OnPolicySingleTurn(
        Tokens(), Replay(Placement(module=policy, device=torch.device("cpu")), 5, 1.0, truncation)
    )
    groups = rollout(proposer, items(), request)
    for ours, theirs in zip(groups, expected):
        assert [c.token_ids for c in ours.completions] == [c.token_ids for c in theirs.completions]
        assert [c.finish_reason for c in ours.completions] == [c.finish_reason for c in theirs.completions]
    metrics = rollout.last_metrics
    assert metrics["on_policy/replaced_tokens"] > 0 and metrics["on_policy/rounds"] >= 2
    assert metrics["on_policy/unchecked_tokens"] == 0
    # The log-probs are the trainer's forward's in the update's layout, bit for bit.
    batch = collate(groups, 0, torch.device("cpu"))
    for start in range(0, len(batch), 5):
        part = batch.rows(start, min(start + 5, len(batch)))
        input_ids = torch.cat([part.prompt_ids, part.completion_ids], dim=1)
        mask = torch.cat([part.prompt_mask, part.completion_mask], dim=1) if part.left_padded else None
        with torch.no_grad():
            options = LogprobOptions(truncation=truncation)
            logps, _ = sequence_logprobs(policy, input_ids, mask, part.completion_ids.shape[1], options)
        assert torch.equal(logps * part.completion_mask, part.sampling_logps)


def test_an_engine_on_the_trainers_weights_needs_one_round():
    torch.manual_seed(0)
    policy = tiny()
    rollout = OnPolicySingleTurn(
        Tokens(), Replay(Placement(module=policy, device=torch.device("cpu")), 4, 1.0)
    )
    rollout(engine(policy), items(), params())
    assert rollout.last_metrics["on_policy/rounds"] == 1
    assert rollout.last_metrics["on_policy/replaced_tokens"] == 0


def test_unseeded_requests_are_refused():
    policy = tiny()
    rollout = OnPolicySingleTurn(
        Tokens(), Replay(Placement(module=policy, device=torch.device("cpu")), 4, 1.0)
    )
    with pytest.raises(ValueError, match="seed"):
        rollout(engine(policy), items(), SamplingParams(n=2, max_tokens=4))


def test_a_run_with_on_policy_sampling_trains_with_no_gap(tmp_path):
    history = run(recipe(tmp_path, max_steps=2, on_policy_sampling=True, top_p=0.9))
    for step in history:
        assert step["on_policy/rounds"] >= 1 and step["on_policy/unchecked_tokens"] == 0
        assert step["sampling/sampling_logp_difference/max"] == 0


def test_a_lora_policy_with_in_place_adapters_trains_with_no_gap(tmp_path):
    """The native engine applies the adapters unmerged; the trainer replays through PEFT's layers.
    With the adapters moving every step, each step's tokens and log-probs are still the trainer's."""
    config = recipe(
        tmp_path, max_steps=3, on_policy_sampling=True, train_type="lora", lora_rank=4, lora_dropout=0.0,
        learning_rate=0.01,
    )  # fmt: skip
    history = run(config)
    assert [step["sampling/sampling_logp_difference/max"] for step in history] == [0.0] * 3
    assert all(step["on_policy/unchecked_tokens"] == 0 for step in history)


def test_a_mixture_of_experts_policy_trains_with_no_gap_through_its_own_routers(tmp_path):
    # routing_replay auto: the completions are the trainer's draws, with nothing of the engine's
    # routing to replay.
    config = recipe(tmp_path, on_policy_sampling=True, model="random:tiny-moe", max_steps=2)
    history = run(config)
    assert [step["sampling/sampling_logp_difference/max"] for step in history] == [0.0] * 2
    assert all("routing/mismatch_fraction" not in step for step in history)


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"use_vllm": True}, "vllm"),
        ({"rollout_engine": "hf"}, "hf"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"replay_sampling_truncation": False}, "replay_sampling_truncation"),
        ({"train_type": "lora", "lora_dropout": 0.05}, "lora_dropout"),
        ({"rollout_func": "grpoflow.tasks.echo:echo_reward"}, "rollout_func"),
        ({"model": "random:tiny-moe", "routing_replay": True}, "routing_replay"),
    ],
)
def test_on_policy_sampling_refuses_what_it_cannot_replay(tmp_path, overrides, named):
    with pytest.raises(ValueError, match=f"on_policy_sampling.*{named}"):
        recipe(tmp_path, on_policy_sampling=True, **overrides)


def test_a_run_on_the_batch_invariant_kernels_settles_every_step_in_one_round(tmp_path):
    """The engine's forward and the trainer's share the kernels: the replay agrees with every draw."""
    config = recipe(
        tmp_path, max_steps=2, on_policy_sampling=True, batch_invariant=True, torch_dtype="bfloat16",
        top_p=0.9, max_completion_length=16,
    )  # fmt: skip
    for step in run(config):
        assert step["on_policy/rounds"] == 1 and step["on_policy/replaced_tokens"] == 0
        assert step["sampling/sampling_logp_difference/max"] == 0


def test_the_update_checks_a_batch_invariant_engines_draws_and_nothing_is_replayed(tmp_path):
    """on_policy_check auto is update where the kernels run and nothing truncates: the engine's
    draws stand, scored as the trainer scores them, and the update finds every log-prob equal."""
    config = recipe(
        tmp_path, max_steps=2, on_policy_sampling=True, batch_invariant=True, torch_dtype="bfloat16",
        max_completion_length=16,
    )  # fmt: skip
    for step in run(config):
        assert "on_policy/rounds" not in step and step["on_policy/unverified_fraction"] == 0
        assert step["sampling/sampling_logp_difference/max"] == 0


def test_a_lora_run_on_the_batch_invariant_kernels_passes_the_updates_check(tmp_path):
    """The engine applies the PEFT layers' adapters as their forward does, on the same kernels;
    the adapters move every step."""
    config = recipe(
        tmp_path, max_steps=2, on_policy_sampling=True, batch_invariant=True, torch_dtype="bfloat16",
        train_type="lora", lora_rank=4, lora_alpha=6, lora_dropout=0.0, learning_rate=0.01,
        max_completion_length=16,
    )  # fmt: skip
    for step in run(config):
        assert step["on_policy/unverified_fraction"] == 0
        assert step["sampling/sampling_logp_difference/max"] == 0


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"on_policy_sampling": False}, "on_policy_sampling: true"),
        ({"top_p": 0.9}, "untruncated"),
        ({"batch_invariant": False}, "batch-invariant"),
    ],
)
def test_the_updates_check_is_refused_where_it_cannot_hold(tmp_path, overrides, named):
    values = {"on_policy_sampling": True, "on_policy_check": "update", **overrides}
    with pytest.raises(ValueError, match=f"on_policy_check.*{named}"):
        recipe(tmp_path, **values)


def test_the_updates_check_without_the_kernels_is_refused_when_the_run_is_built(tmp_path):
    # batch_invariant auto leaves the kernels off on the CPU
    with pytest.raises(ValueError, match="on_policy_check: update needs the batch-invariant kernels"):
        run(recipe(tmp_path, max_steps=1, on_policy_sampling=True, on_policy_check="update"))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [({"rollout_engine": "hf"}, "batch_invariant"), ({"torch_compile": True}, "torch_compile")],
)
def test_batch_invariant_refuses_what_would_break_its_match(tmp_path, overrides, named):
    with pytest.raises(ValueError, match=named):
        run(recipe(tmp_path, max_steps=1, on_policy_sampling=False, batch_invariant=True, **overrides))


def test_a_mixture_of_experts_run_on_the_kernels_passes_the_updates_check_without_replay(tmp_path):
    """The engine's routers and experts are the trainer's bit for bit: the engine's draws stand, every
    log-prob verified, and routing_replay auto replays nothing (no routing recorded or compared)."""
    config = recipe(
        tmp_path, max_steps=2, on_policy_sampling=True, on_policy_check="update", batch_invariant=True,
        torch_dtype="bfloat16", model="random:tiny-moe", max_completion_length=16,
    )  # fmt: skip
    for step in run(config):
        assert step["on_policy/unverified_fraction"] == 0 and "routing/mismatch_fraction" not in step
        assert step["sampling/sampling_logp_difference/max"] == 0
