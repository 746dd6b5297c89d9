"""Agent programs under on_policy_sampling with the update's check (CPU, the batch-invariant
kernels): the hosted engine scores every turn's tokens as the trainer does, so a program's
episodes train as the policy's own draws, unless a turn reached the server with sampling other
than the run's, which is never counted as verified."""

from __future__ import annotations

import logging
import math

import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from helpers.support import recipe  # noqa: E402

from grpoflow.engines import SamplingParams  # noqa: E402
from grpoflow.rollout.program_turns import unverifiable  # noqa: E402
from grpoflow.run.build import run  # noqa: E402

EXACT = dict(
    max_steps=2, on_policy_sampling=True, batch_invariant=True, torch_dtype="bfloat16", dataset="relay",
    reward_funcs=[], max_turn_tokens=4, max_prompt_length=16, max_completion_length=24,
)  # fmt: skip
"""A short run of the relay on the batch-invariant kernels, its check auto (update there)."""


def test_a_multi_turn_program_asking_for_its_own_sampling_trains_as_the_policys_draws(tmp_path):
    """The program asks for greedy nucleus sampling; the client it is given samples as the run does."""
    config = recipe(tmp_path, agent_program="helpers.agent_programs:choosy_relay", **EXACT)
    for step in run(config):
        assert step["episodes/turns_mean"] == 2 and step["episodes/errors"] == 0
        assert step["on_policy/foreign_turn_fraction"] == 0
        assert step["on_policy/unverified_fraction"] == 0
        assert step["sampling/sampling_logp_difference/max"] == 0


def test_turns_that_reach_the_server_with_other_sampling_are_never_verified(tmp_path, caplog):
    """A greedy one-token turn sent past the client: the engine's score of it equals the trainer's
    log-prob bit for bit, yet it is no draw of the policy at temperature 1."""
    config = recipe(tmp_path, agent_program="helpers.agent_programs:bypassing_relay", **EXACT)
    with caplog.at_level(logging.WARNING, logger="grpoflow.agents"):
        history = run(config)
    for step in history:
        assert step["on_policy/foreign_turn_fraction"] == 1
        assert step["on_policy/unverified_fraction"] == 1
    assert caplog.text.count("not the policy's draws") == 1
    assert "'temperature': 0.0" in caplog.text


def test_a_turn_without_the_runs_sampling_on_record_has_no_log_probs():
    params = SamplingParams(temperature=0.7, top_k=0)
    same = {"completion_ids": [3, 4], "completion_logprobs": [-0.5, -1.0], "sampling": params.distribution()}
    other = {**same, "sampling": {**params.distribution(), "top_p": 0.9}}
    unnamed = {key: value for key, value in same.items() if key != "sampling"}
    turns, foreign = unverifiable([same, other, unnamed], SamplingParams(temperature=0.7, top_k=-1))
    assert turns[0] is same and foreign == [other["sampling"], None]
    assert all(math.isnan(value) for turn in turns[1:] for value in turn["completion_logprobs"])


@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        ({"on_policy_check": "replay"}, "'replay'"),
        ({"batch_invariant": False}, "'auto'"),
        ({"top_p": 0.9}, "'auto'"),
    ],
)
def test_an_agent_program_is_refused_a_check_that_would_redraw(tmp_path, overrides, shown):
    values = {**EXACT, "agent_program": "helpers.agent_programs:choosy_relay", **overrides}
    with pytest.raises(
        ValueError, match=f"on_policy_check must be update .* got {shown}.*on_policy_check: update"
    ):
        recipe(tmp_path, **values)


@pytest.mark.skipif(torch.cuda.is_available(), reason="batch_invariant auto runs the kernels on CUDA")
def test_an_agent_program_is_refused_when_auto_chooses_replay(tmp_path):
    # batch_invariant auto leaves the kernels off on the CPU
    values = {**EXACT, "agent_program": "helpers.agent_programs:choosy_relay", "batch_invariant": "auto"}
    with pytest.raises(ValueError, match="auto chose replay.*set batch_invariant: true"):
        run(recipe(tmp_path, **values))
