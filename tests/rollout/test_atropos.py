"""Training on Atropos: scored groups from atroposlib's trajectory API (`run-api`) become the
trainer's groups, and `grpoflow train` trains on an atroposlib environment that samples from
`grpoflow serve`, each in a process of its own. Runs on the CPU."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("atroposlib")
import httpx  # noqa: E402
from helpers.atropos_api import letter_environment, trajectory_api  # noqa: E402
from helpers.atropos_env import GROUP_SIZE, LETTERS, PROMPT, letter_score  # noqa: E402

from grpoflow.agents.atropos_client import AtroposClient, AtroposConfig  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer  # noqa: E402
from grpoflow.rollout.atropos import AtroposGroups, shared_prompt_length  # noqa: E402
from grpoflow.rollout.batch import collate  # noqa: E402
from grpoflow.run.config import GRPOConfig  # noqa: E402
from grpoflow.run.infer_workers import RolloutServers  # noqa: E402

IGNORED = -100


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[str]:
    with trajectory_api(tmp_path_factory.mktemp("atropos-api")) as url:
        yield url


def batches_from(api: str, groups: list[dict], batch_size: int) -> AtroposGroups:
    """A registered AtroposGroups on `api`, emptied first, with `groups` posted."""
    httpx.get(f"{api}/reset_data", timeout=10).raise_for_status()
    config = AtroposConfig(
        atropos_url=api,
        atropos_batch_size=batch_size,
        atropos_poll_seconds=0.05,
        atropos_max_wait_seconds=10,
    )
    batches = AtroposGroups(AtroposClient(config), build_char_tokenizer())
    batches.start(total_steps=5, step=0)
    for group in groups:
        httpx.post(f"{api}/scored_data", json=group, timeout=10).raise_for_status()
    return batches


def test_a_multi_turn_group_splits_at_its_shared_prompt_and_keeps_masks_and_logprobs(api):
    # Two episodes of one prompt [5, 6, 7]: the second has an environment turn (ids 40, 41) between
    # its sampled turns; masks say which tokens the policy sampled.
    tokens = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 40, 41, 11]]
    masks = [
        [IGNORED, IGNORED, IGNORED, 8, 9],
        [IGNORED, IGNORED, IGNORED, 10, IGNORED, IGNORED, 11],
    ]
    logprobs = [[1.0, 1.0, 1.0, -0.5, -0.25], [1.0, 1.0, 1.0, -1.0, 1.0, 1.0, -2.0]]
    group = {"tokens": tokens, "masks": masks, "scores": [1.0, 0.0], "inference_logprobs": logprobs}
    source = batches_from(api, [group], batch_size=2)
    scored = source.next(0)
    source.close()
    (trainer_group,) = scored.groups
    assert trainer_group.item.prompt_ids == [5, 6, 7]
    first, second = trainer_group.completions
    assert (first.token_ids, first.loss_mask, first.logprobs) == ([8, 9], [1, 1], [-0.5, -0.25])
    assert second.token_ids == [10, 40, 41, 11]
    assert second.loss_mask == [1, 0, 0, 1]
    assert second.logprobs == [-1.0, 0.0, 0.0, -2.0]  # Atropos's 1.0 placeholders are not log-probs
    assert scored.rewards.tolist() == [[1.0], [0.0]]
    assert scored.group_sizes == [2] and scored.sampling_logprobs
    batch = collate(scored.groups, 0, torch.device("cpu"))
    assert batch.loss_mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 1]]
    # Every id the environment posted is in the training rows, in order.
    for row, sequence in enumerate(tokens):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        completion = batch.completion_ids[row][batch.completion_mask[row].bool()].tolist()
        assert prompt + completion == sequence


def test_groups_of_different_sizes_overrides_and_missing_logprobs(api, caplog):
    # Atropos packs groups whose sizes are powers of two into batches of a multiple of the largest.
    small = {"tokens": [[5, 6, 1], [5, 6, 2]], "masks": [[IGNORED, IGNORED, 1], [IGNORED, IGNORED, 2]]}
    small |= {"scores": [0.0, 1.0], "overrides": [{"set_advantage_to_zero": True}, {"temperature": 0.5}]}
    large = {
        "tokens": [[7, 3], [7, 4], [7, 5], [7, 6]],
        "masks": [[IGNORED, 3], [IGNORED, 4], [IGNORED, 5], [IGNORED, 6]],
        "scores": [1.0, 0.5, 0.0, 0.0],
    }
    source = batches_from(api, [small, large, {**small, "overrides": None}], batch_size=8)
    with caplog.at_level(logging.WARNING, logger="grpoflow"):
        scored = source.next(0)
    source.close()
    assert sorted(scored.group_sizes) == [2, 2, 4]
    assert len(scored.rewards) == 8 and int(scored.zero_advantage.sum()) == 1
    zeroed = [c.token_ids for g in scored.groups for c in g.completions][int(scored.zero_advantage.nonzero())]
    assert zeroed == [1]
    assert not scored.sampling_logprobs
    assert "without inference_logprobs" in caplog.text
    assert "'temperature'" in caplog.text


def test_the_shared_prompt_stops_before_the_first_trained_token():
    assert shared_prompt_length([[1, 2, 3], [1, 2, 3]], [2, 3]) == 2
    assert shared_prompt_length([[1, 2, 3], [4, 2, 3]], [2, 2]) == 0


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({}, "use_vllm: true, vllm_mode: server"),
        ({"use_vllm": True, "vllm_mode": "server"}, "max_steps"),
        ({"use_vllm": True, "vllm_mode": "server", "max_steps": 3, "reward_funcs": ["echo"]}, "reward_funcs"),
        ({"use_vllm": True, "vllm_mode": "server", "max_steps": 3, "dataset": ["echo"]}, "dataset"),
    ],
)
def test_an_atropos_run_refuses_settings_it_cannot_honour(flags, words):
    with pytest.raises(ValueError) as error:
        GRPOConfig.from_flat_dict({"model": "tiny", "atropos_url": "http://localhost:8000", **flags})
    assert words in str(error.value)


@pytest.mark.slow
def test_grpoflow_train_trains_on_an_atropos_environment_sampling_grpoflow_serve(tmp_path):
    steps = 3
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    output = tmp_path / "run"
    with trajectory_api(tmp_path) as api, RolloutServers(["--model", "tiny"], [None], tmp_path) as servers:
        server = servers.urls[0]
        with letter_environment(api, server, tmp_path / "tokenizer", tmp_path / "env.log"):
            servers.wait_until_healthy(120)
            command = [
                sys.executable,
                "-m",
                "grpoflow",
                "train",
                *("--model", "tiny", "--atropos_url", api, "--atropos_poll_seconds", "0.1"),
                *("--atropos_max_wait_seconds", "120", "--max_steps", str(steps)),
                *("--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", server),
                *("--per_device_train_batch_size", str(2 * GROUP_SIZE), "--learning_rate", "1e-3"),
                *("--output_dir", str(output), "--report_to", "none", "--log_completions", "true"),
            ]
            trained = subprocess.run(command, capture_output=True, text=True, timeout=300)
            assert trained.returncode == 0, trained.stderr[-3000:]
            version = httpx.get(f"{server}/weight_info", timeout=10).json()["weight_version"]
    assert version == str(steps)  # the trainer's weights reached the server after every step
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == [1, 2, 3]
    assert all(row["sync_check/logprob_gap"] < 0.5 for row in metrics if "sync_check/logprob_gap" in row)
    rows = [json.loads(line) for line in (output / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == steps * 2 * GROUP_SIZE
    prompts = {
        tokenizer.decode(tokenizer(PROMPT.format(letter=letter))["input_ids"]): letter for letter in LETTERS
    }
    for row in rows:  # each score is the environment's, for the completion trained on
        letter = prompts[row["prompt"]]
        assert row["rewards"]["atropos"] == pytest.approx(letter_score(row["completion"], letter))
    assert (output / f"checkpoint-{steps}").is_dir()


@pytest.mark.slow
def test_a_run_whose_environments_post_nothing_stops_naming_the_setting(api, tmp_path):
    from grpoflow.run.build import build_trainer
    from grpoflow.run.failures import RunStopped

    httpx.get(f"{api}/reset_data", timeout=10).raise_for_status()
    with RolloutServers(["--model", "tiny"], [None], tmp_path) as servers:
        servers.wait_until_healthy(120)
        config = GRPOConfig.from_flat_dict(
            {
                "model": "tiny",
                "atropos_url": api,
                "atropos_max_wait_seconds": 0.5,
                "atropos_poll_seconds": 0.1,
                "max_steps": 2,
                "use_vllm": True,
                "vllm_mode": "server",
                "vllm_server_base_url": servers.urls[0],
                "output_dir": str(tmp_path / "run"),
                "report_to": ["none"],
            }
        )
        trainer = build_trainer(config)
        try:
            with pytest.raises(RunStopped) as stopped:
                trainer.train()
        finally:
            trainer.close()
    assert "no batch from the Atropos API" in str(stopped.value)
    assert "atropos_max_wait_seconds" in str(stopped.value)
    assert "--resume_from_checkpoint latest" in str(stopped.value)
