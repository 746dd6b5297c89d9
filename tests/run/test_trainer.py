"""End-to-end runs of the trainer on the embedded tiny model and echo task."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers.support import recipe, save_reward_model, write_plugin

from grpoflow.distributed import DistributedContext
from grpoflow.policy.compile_costs import CompileCostRecorder
from grpoflow.run.build import build_trainer, run, run_observers
from grpoflow.run.checkpoint import list_checkpoints
from grpoflow.run.chosen_settings import choose_for_run, compile_shape, gpu_spec
from grpoflow.run.health import HealthConfig, HealthMonitor


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_reward_rises_on_the_embedded_default(tmp_path):
    # 70 steps: the mean reward of the last 10 is about twice the bound asserted (0.26 > 0.14).
    config = recipe(tmp_path, max_steps=70, per_device_train_batch_size=128, report_to=["tensorboard"])
    history = run(config)
    rewards = [step["reward"] for step in history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    monitor = HealthMonitor(HealthConfig())  # no health check fires on the packaged task
    assert [f for step, metrics in enumerate(history, 1) for f in monitor.update(step, metrics)] == []
    assert first < 0.1
    assert last > 2 * first + 0.1, (first, last)
    logged = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in logged] == list(range(1, 71))
    for key in (
        "reward",
        "reward_std",
        "rewards/echo/mean",
        "frac_reward_zero_std",
        "entropy",
        "completions/mean_length",
        "completions/clipped_ratio",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "time/rollout",
        "time/reward",
        "time/update",
        "time/sync",
        "tokens_per_second/rollout",
        "loss",
        "grad_norm",
        "learning_rate",
    ):
        assert key in logged[-1], key
    assert list((tmp_path / "run" / "runs").glob("events.out.tfevents.*"))
    assert [path.name for path in list_checkpoints(tmp_path / "run")] == ["checkpoint-70"]


def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path):
    straight = recipe(tmp_path / "a", max_steps=6, save_steps=3, num_iterations=2, beta=0.05)
    history = run(straight)
    interrupted = recipe(
        tmp_path / "b",
        max_steps=6,
        num_iterations=2,
        beta=0.05,
        resume_from_checkpoint=str(tmp_path / "a" / "run" / "checkpoint-3"),
    )
    trainer = build_trainer(interrupted)
    assert trainer.step_count == 3
    resumed = trainer.train()
    for expected, got in zip(history[3:], resumed, strict=True):
        assert got["reward"] == expected["reward"]
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-7)
    reference = build_trainer(recipe(tmp_path / "a", resume_from_checkpoint="latest")).model
    for (name, want), (_, got) in zip(reference.state_dict().items(), trainer.model.state_dict().items()):
        torch.testing.assert_close(got, want, msg=name)


def test_observers_see_each_step_and_a_compiled_gpu_run_records_its_compile_cost(tmp_path):
    trainer = build_trainer(recipe(tmp_path, max_steps=2))
    assert trainer.observers == []  # nothing compiled on the CPU: nothing recorded
    seen = []
    trainer.observers.append(lambda step, metrics: seen.append((step, metrics["time/update"])))
    trainer.observe(trainer.step())  # a caller stepping the trainer itself (benchmarks/grpo_step.py)
    trainer.train()  # the rest
    assert [step for step, _ in seen] == [1, 2] and all(update > 0 for _, update in seen)
    compiled = recipe(tmp_path / "compiled", torch_compile=True, gpu_name="H100")
    config, chosen = choose_for_run(compiled)
    (recorder,) = run_observers(config, chosen, DistributedContext())
    assert isinstance(recorder, CompileCostRecorder)
    assert recorder.shape == compile_shape(config, chosen, gpu_spec(config).name)
    assert run_observers(config, chosen, DistributedContext(rank=1, world_size=2)) == []  # rank 0 records


def test_resume_keeps_the_adaptive_entropy_coefficient(tmp_path):
    options = dict(max_steps=4, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=100.0)
    history = run(recipe(tmp_path / "a", save_steps=2, **options))
    assert history[-1]["entropy_coef"] > history[0]["entropy_coef"]  # it moved every step
    resumed = build_trainer(
        recipe(tmp_path / "b", resume_from_checkpoint=str(tmp_path / "a" / "run" / "checkpoint-2"), **options)
    ).train()
    for expected, got in zip(history[2:], resumed, strict=True):
        assert got["entropy_coef"] == pytest.approx(expected["entropy_coef"])
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-7)


def test_kl_and_several_iterations_report_their_metrics(tmp_path):
    history = run(recipe(tmp_path, max_steps=2, beta=0.1, num_iterations=3, epsilon_high=0.28))
    assert all(math.isfinite(step["kl"]) for step in history)
    assert history[-1]["kl"] > 0  # after an update the policy left the reference


def test_padding_free_runs_train_as_padded_ones(tmp_path):
    """Step 1 samples the same rollouts either way; the packed update gives the same loss, and a
    token budget (micro-batches of unequal sizes) the same loss again for dapo."""
    common = dict(max_steps=1, beta=0.1, num_iterations=2)
    padded = run(recipe(tmp_path / "padded", **common))[0]
    packed = run(recipe(tmp_path / "packed", padding_free=True, **common))[0]
    budget = run(recipe(tmp_path / "budget", padding_free=True, max_tokens_per_micro_batch=300, **common))[0]
    assert packed["reward"] == padded["reward"] == budget["reward"]
    for name in ("loss", "kl", "entropy"):
        assert packed[name] == pytest.approx(padded[name], rel=1e-4, abs=1e-6), name
    assert budget["loss"] == pytest.approx(padded["loss"], rel=1e-4, abs=1e-6)


def test_overlong_filter_gives_truncated_completions_no_loss(tmp_path):
    # max_completion_length 2: every completion of the untrained model is truncated.
    history = run(recipe(tmp_path, max_steps=1, max_completion_length=2, overlong_filter=True))
    assert history[0]["completions/clipped_ratio"] > 0.9
    assert history[0]["loss"] == 0.0


def test_a_raising_reward_is_reported_and_the_run_goes_on(tmp_path):
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "def flaky(completions, letter, **kwargs):\n"
        "    if set(letter) & set('abcd'):\n"
        "        raise RuntimeError('bad sample')\n"
        "    return [1.0 for _ in completions]\n"
    )
    config = recipe(
        tmp_path,
        max_steps=2,
        per_device_train_batch_size=64,
        reward_funcs=["echo", f"{plugin}:flaky"],
        log_completions=True,
    )
    history = run(config)
    assert len(history) == 2
    assert sum(step["rewards/num_errors"] for step in history) > 0
    rows = read_jsonl(tmp_path / "run" / "completions.jsonl")
    assert len(rows) == 2 * 64
    assert {"prompt", "completion", "rewards", "advantage", "step"} <= set(rows[0])
    missing = [row for row in rows if row["rewards"]["flaky"] is None]
    assert missing and all(row["prompt"][5] in "abcd" for row in missing)
    assert all(row["rewards"]["flaky"] == 1.0 for row in rows if row["prompt"][5] in "efgh")


@pytest.mark.parametrize("others", [["echo"], ["echo", "format"]], ids=["two_rewards", "three_rewards"])
def test_a_sample_whose_reward_failed_is_left_out_whatever_the_number_of_rewards(tmp_path, others):
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "def flaky(completions, letter, **kwargs):\n"
        "    if set(letter) & set('abcd'):\n"
        "        raise RuntimeError('bad sample')\n"
        "    return [float(len(c) % 2) for c in completions]\n"
    )
    config = recipe(
        tmp_path,
        max_steps=2,
        per_device_train_batch_size=64,
        reward_funcs=[*others, f"{plugin}:flaky"],
        log_completions=True,
    )
    history = run(config)
    rows = read_jsonl(tmp_path / "run" / "completions.jsonl")
    failed = [row for row in rows if row["prompt"][5] in "abcd"]
    assert failed and all(set(row["rewards"].values()) == {None} for row in failed)
    assert all(row["advantage"] == 0.0 for row in failed)
    for step, metrics in enumerate(history, start=1):
        scored = [row for row in rows if row["step"] == step and None not in row["rewards"].values()]
        assert scored
        assert metrics["reward"] == pytest.approx(
            sum(sum(row["rewards"].values()) for row in scored) / len(scored)
        )
        flaky = [row["rewards"]["flaky"] for row in scored]
        assert metrics["rewards/flaky/mean"] == pytest.approx(sum(flaky) / len(flaky))


def test_a_reward_that_does_not_apply_to_a_sample_leaves_its_other_rewards_counting():
    from grpoflow.rewards import RewardRunner

    def applies_to_odd(completions, **kwargs):
        return [None if index % 2 == 0 else 1.0 for index in range(len(completions))]

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    with RewardRunner([("odd", applies_to_odd), ("length", length)], timeout=10, num_workers=0) as runner:
        batch = runner.score(["p"] * 2, ["ab", "abc"], [[1, 2], [1, 2, 3]])
    assert batch.errors == []
    assert batch.training_values[0, 1].item() == 2.0 and batch.training_values[1].tolist() == [1.0, 3.0]


def test_dynamic_sampling_replaces_groups_without_reward_spread(tmp_path):
    plugin = write_plugin(tmp_path)
    config = recipe(
        tmp_path,
        max_steps=2,
        reward_funcs=[f"{plugin}:half"],
        dynamic_sample=True,
        max_resample_times=4,
        per_device_train_batch_size=32,
    )
    history = run(config)
    assert max(step["dynamic_sample/rounds"] for step in history) > 1
    assert all(step["frac_reward_zero_std"] < 0.5 for step in history)


def test_reward_model_and_plugin_rewards_are_weighted_into_the_run(tmp_path):
    reward_dir = tmp_path / "reward_model"
    save_reward_model(reward_dir)
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "from grpoflow.rewards import register_reward\n"
        "@register_reward('short')\n"
        "def short(completions, **kwargs):\n"
        "    return [-len(c) / 8 for c in completions]\n"
    )
    run_config = recipe(
        tmp_path,
        max_steps=1,
        external_plugins=[str(plugin)],
        reward_funcs=["echo", "short"],
        reward_model=str(reward_dir),
        reward_weights=[1.0, 0.5, 0.1],
    )
    (step,) = run(run_config)
    assert {"rewards/echo/mean", "rewards/short/mean", "rewards/reward_model/mean"} <= set(step)
    assert step["rewards/short/mean"] < 0
    assert math.isfinite(step["rewards/reward_model/mean"])
    weighted = (
        step["rewards/echo/mean"] + 0.5 * step["rewards/short/mean"] + 0.1 * step["rewards/reward_model/mean"]
    )
    assert step["reward"] == pytest.approx(weighted, abs=1e-5)


def test_the_native_engines_logprob_gap_is_logged_and_its_correction_can_be_turned_on(tmp_path):
    plain = run(recipe(tmp_path / "plain", max_steps=2))
    for step in plain:
        assert 0 <= step["sampling/sampling_logp_difference/mean"] < 1e-3  # the CPU's float32 ops
        assert "sampling/importance_sampling_ratio/mean" not in step
    corrected = run(recipe(tmp_path / "corrected", max_steps=2, vllm_importance_sampling_correction=True))
    for step in corrected:
        assert step["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-2)


def test_truncated_sampling_is_replayed_so_the_engines_logprobs_match_the_trainers(tmp_path):
    replayed = run(recipe(tmp_path / "replayed", max_steps=2, top_p=0.8, top_k=20))
    unreplayed = run(
        recipe(tmp_path / "full", max_steps=2, top_p=0.8, top_k=20, replay_sampling_truncation=False)
    )
    packed = run(recipe(tmp_path / "packed", max_steps=2, top_p=0.8, top_k=20, padding_free=True))
    for step in replayed + packed:
        assert step["sampling/sampling_logp_difference/mean"] < 1e-3  # the CPU's float32 ops
    for step in unreplayed:
        # The whole vocabulary's log-probs sit log(kept mass) below the engine's: a bias, not noise.
        assert step["sampling/sampling_logp_difference/mean"] > 1e-2
