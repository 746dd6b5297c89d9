"""The speed settings a run leaves unset, chosen for its device: the CPU keeps today's defaults at
no cost, a GPU's memory (given as a number) chooses from the plan, run.json records each setting's
source, and `grpoflow plan` prints the choice and the step time it predicts."""

from __future__ import annotations

import json

import pytest
from helpers.support import recipe

from grpoflow.cli import main
from grpoflow.policy.auto_settings import DeviceFacts
from grpoflow.policy.compile_costs import record_seconds
from grpoflow.policy.memory_plan import GIB
from grpoflow.run.build import build_trainer
from grpoflow.run.chosen_settings import (
    applied,
    choose,
    choose_for_run,
    chosen_record,
    compile_shape,
    gpu_spec,
    predicted_step,
)

STANDARD = {
    "model": "random:qwen2-0.5b",
    "gradient_accumulation_steps": 64,
    "max_prompt_length": 128,
    "max_completion_length": 256,
}
"""The standard workload's shape with the speed settings unset: 8 x 64 = 512 completions a step."""


def unset(config):
    """`config` with the speed settings the QUICK recipe sets left unset."""
    return config.__class__.from_flat_dict(
        {key: value for key, value in config.to_flat_dict().items() if key != "per_device_train_batch_size"}
    )


@pytest.mark.parametrize("shared_prompts, micro_batch", [(None, 128), (False, 64)])
def test_a_gpu_of_80_gib_trains_the_standard_workload_fast(tmp_path, caplog, shared_prompts, micro_batch):
    """Shared prompts (auto: on) run 128 completions in the memory 64 padded ones take."""
    config = unset(recipe(tmp_path, **STANDARD, shared_prompts=shared_prompts))
    chosen = choose(config, DeviceFacts("cuda", 80 * GIB, compile_available=True))
    assert chosen.shared_prompts is (shared_prompts is None)
    trained = applied(config, chosen)
    with caplog.at_level("INFO", logger="grpoflow"):
        record = chosen_record(trained, chosen, kv_blocks=6144)
    assert record["num_kv_blocks"] == {"value": 6144, "source": "plan"}
    lines = [r.getMessage() for r in caplog.records if "settings chosen from the plan" in r.getMessage()]
    assert (
        len(lines) == 1
        and f"per_device_train_batch_size={micro_batch}" in lines[0]
        and "KV cache 6144 blocks" in lines[0]
    )
    assert trained.generation_batch_size == config.generation_batch_size == 512
    assert (trained.training.per_device_train_batch_size, trained.training.gradient_accumulation_steps) == (
        micro_batch,
        512 // micro_batch,
    )
    assert trained.policy.gradient_checkpointing is False
    assert trained.policy.torch_compile and trained.policy.compile_fallback  # chosen: may fall back
    given = applied(
        recipe(tmp_path, **STANDARD, torch_compile=True),
        choose(recipe(tmp_path, **STANDARD, torch_compile=True), DeviceFacts("cuda", 80 * GIB)),
    )
    assert given.policy.torch_compile and not given.policy.compile_fallback


def test_the_cpu_keeps_the_defaults_and_run_json_records_their_sources(tmp_path):
    config = unset(recipe(tmp_path, gradient_checkpointing=False))
    trained, chosen = choose_for_run(config)
    assert trained.training.per_device_train_batch_size == 8 and trained.policy.torch_compile is False
    assert trained.generation_batch_size == config.generation_batch_size
    assert chosen.sources["gradient_checkpointing"] == "user"
    build_trainer(config).close()
    record = json.loads((tmp_path / "run" / "run.json").read_text())["chosen_settings"]
    assert record["gradient_checkpointing"] == {"value": False, "source": "user"}
    assert record["per_device_train_batch_size"] == {"value": 8, "source": "default"}
    assert record["torch_compile"] == {"value": False, "source": "default"}


def test_plan_prints_the_chosen_settings_and_the_predicted_step(capsys):
    flags = [
        f"--{key}={value}" for key, value in {**STANDARD, "dataset": "echo", "reward_funcs": "echo"}.items()
    ]
    code = main(["plan", *flags, "--gpu_memory_gib", "80", "--gpu_name", "H100"])
    out = capsys.readouterr().out
    assert code == 0
    assert "gradient_checkpointing=False (plan), per_device_train_batch_size=128 (plan)" in out
    assert "predicted step" in out and "rollout" in out and "update" in out and "GPU: H100" in out
    # As the run chooses it, the engine's cache kept through the update, and planned into it.
    assert "sleep_level=0 (plan)" in out
    kv_row = next(line for line in out.splitlines() if line.startswith("kv_cache"))
    rollout, update = map(float, kv_row.split()[1:])
    assert rollout == update > 0
    # The default recipe sets per_device_train_batch_size: 128, which the plan keeps.
    code = main(["plan", "--config", "default", "--model", "random:qwen2-0.5b", "--gpu_memory_gib", "80"])
    assert "per_device_train_batch_size=128 (user)" in capsys.readouterr().out


def test_a_gpu_unknown_to_the_table_needs_its_measured_figures(tmp_path, capsys):
    code = main(
        [
            "plan",
            "--config",
            "default",
            "--model",
            "random:qwen2-0.5b",
            "--gpu_memory_gib",
            "80",
            "--gpu_name",
            "T4",
        ]
    )
    assert code == 2 and "gpu_name must be one of H100, H200, A100" in capsys.readouterr().err
    config = recipe(tmp_path, **STANDARD, gpu_name="T4", gpu_memory_bandwidth_tbps=0.3, gpu_bf16_tflops=65)
    spec = gpu_spec(config)
    assert spec.bandwidth == 0.3e12 and spec.bf16_flops == 65e12
    faster = gpu_spec(recipe(tmp_path, **STANDARD, gpu_name="H100", gpu_bf16_tflops=989))
    assert predicted_step(config, spec).total > predicted_step(config, faster).total


def test_a_run_too_short_to_pay_for_compiling_is_left_eager(tmp_path, caplog):
    gpu = DeviceFacts("cuda", 80 * GIB, compile_available=True)
    short = unset(recipe(tmp_path, **STANDARD, gpu_name="H100", max_steps=5))
    with caplog.at_level("INFO", logger="grpoflow"):
        chosen = choose(short, gpu)
    assert chosen.torch_compile is False and chosen.sources["torch_compile"] == "plan"
    assert any("5 steps would save about" in r.getMessage() for r in caplog.records)
    assert choose(unset(recipe(tmp_path, **STANDARD, gpu_name="H100", max_steps=500)), gpu).torch_compile
    given = unset(recipe(tmp_path, **STANDARD, gpu_name="H100", max_steps=5, torch_compile=True))
    assert choose(given, gpu).torch_compile  # a setting given is kept
    # compiling a full update (~15 s) saves ~0.07 s a step over eager with Liger's kernels (on
    # where compile is off), ~0.7 s without them: 50 steps pay only for the latter
    assert not choose(unset(recipe(tmp_path, **STANDARD, gpu_name="H100", max_steps=50)), gpu).torch_compile
    unfused = unset(recipe(tmp_path, **STANDARD, gpu_name="H100", max_steps=50, use_liger_kernel=False))
    assert choose(unfused, gpu).torch_compile
    # compiling gains LoRA's update ~0.5 s a step by the planner's figures: 50 steps pay, 20 do not
    lora = unset(recipe(tmp_path, **STANDARD, gpu_name="H100", max_steps=50, train_type="lora"))
    assert choose(lora, gpu).torch_compile
    lora = unset(recipe(tmp_path, **STANDARD, gpu_name="H100", max_steps=20, train_type="lora"))
    with caplog.at_level("INFO", logger="grpoflow"):
        assert not choose(lora, gpu).torch_compile
    assert any(
        "compiling costs (about 15 s, with Inductor's caches empty)" in r.getMessage() for r in caplog.records
    )


def test_a_cost_measured_by_earlier_runs_of_the_shapes_decides_instead(tmp_path, caplog):
    """20 LoRA steps do not pay for compiling with empty caches (~15 s), but do where earlier runs
    of the same shapes found compiling cheaper; another model's record changes nothing."""
    gpu = DeviceFacts("cuda", 80 * GIB, compile_available=True)
    lora = unset(recipe(tmp_path, **STANDARD, gpu_name="H100", max_steps=20, train_type="lora"))
    eager = choose(lora, gpu)
    assert not eager.torch_compile
    shape = compile_shape(lora, eager, gpu_spec(lora).name)
    other = unset(recipe(tmp_path, **STANDARD, gpu_name="H100", max_steps=20, train_type="full"))
    assert compile_shape(other, eager, gpu_spec(lora).name) != shape
    record_seconds(shape, 15.0)  # a first run: a later one is expected to pay a share of it
    record_seconds(shape, 3.0)  # a run that found the artifacts
    chosen = choose(lora, gpu)
    assert chosen.torch_compile and chosen.sources["torch_compile"] == "plan"
    assert (
        chosen.reasons["torch_compile"] == "compiling costs about 3 s, as earlier runs of these shapes paid"
    )
    short = unset(recipe(tmp_path, **STANDARD, gpu_name="H100", max_steps=3, train_type="lora"))
    with caplog.at_level("INFO", logger="grpoflow"):
        assert not choose(short, gpu).torch_compile
    assert any("(about 3 s, as earlier runs of these shapes paid)" in r.getMessage() for r in caplog.records)


def test_a_copy_of_the_model_elsewhere_shares_its_compile_record_and_another_shape_does_not(tmp_path):
    from transformers import Qwen2Config

    chosen = choose(unset(recipe(tmp_path, **STANDARD, gpu_name="H100")), DeviceFacts("cpu"))
    keys = []
    for name, width in (("here", 64), ("copy", 64), ("wider", 128)):
        Qwen2Config(hidden_size=width, num_attention_heads=4, num_key_value_heads=2).save_pretrained(
            tmp_path / name
        )
        config = recipe(tmp_path, **{**STANDARD, "model": str(tmp_path / name)}, gpu_name="H100")
        keys.append(compile_shape(config, chosen, "NVIDIA H100"))
    assert keys[0] == keys[1] != keys[2]


def test_each_groups_prompt_runs_through_the_update_once_where_it_can(tmp_path, caplog):
    gpu = DeviceFacts("cuda", 80 * GIB, compile_available=True)
    config = unset(recipe(tmp_path, **STANDARD, gpu_name="H100"))
    with caplog.at_level("INFO", logger="grpoflow"):
        chosen = choose(config, gpu)
    assert chosen.shared_prompts and chosen.sources["shared_prompts"] == "default"
    assert any("shared_prompts=True (auto" in r.getMessage() for r in caplog.records)
    trained = applied(config, chosen)
    assert trained.training.shared_prompts and trained.policy.attn_implementation == "grpoflow_varlen"
    assert trained.policy.attn_fallback  # chosen, not given: a model that cannot take it keeps its own
    assert not trained.groups_by_length() and trained.update_settings(copies_weights=False).shared_prompts
    assert chosen.record()["shared_prompts"]["reason"].startswith("auto: each group's prompt")
    unshared = applied(
        config, choose(unset(recipe(tmp_path, **STANDARD, gpu_name="H100", shared_prompts=False)), gpu)
    )
    spec = gpu_spec(trained)
    assert predicted_step(trained, spec).update < 0.8 * predicted_step(unshared, spec).update

    off = {
        "the CPU": (config, DeviceFacts("cpu")),
        "another attention": (recipe(tmp_path, **STANDARD, attn_implementation="sdpa"), gpu),
    }
    for case, (other, device) in off.items():
        kept = choose(other, device)
        assert not kept.shared_prompts, case
        assert applied(other, kept).policy.attn_implementation == other.policy.attn_implementation, case
    assert "attn_implementation is 'sdpa'" in choose(*off["another attention"]).reasons["shared_prompts"]
    with pytest.raises(ValueError, match="shared_prompts: true cannot run: off the GPU"):
        choose(recipe(tmp_path, **STANDARD, shared_prompts=True), DeviceFacts("cpu"))


def test_a_run_sharing_prompts_takes_the_step_a_padded_run_takes(tmp_path, monkeypatch):
    """The CPU let choose shared prompts (its per-sequence attention), against the same run
    padded: the same first step, to float32 rounding (old-policy and reference passes too)."""
    from grpoflow.run import chosen_settings
    from grpoflow.run.build import run

    def first_step(directory, shared: bool) -> dict:
        if shared:
            monkeypatch.setattr(chosen_settings, "shared_prompts_refusal", lambda config, device: None)
        config = recipe(directory, max_steps=1, beta=0.04, num_iterations=2)
        (step,) = run(config)
        chosen = json.loads((directory / "run" / "run.json").read_text())["chosen_settings"]
        assert chosen["shared_prompts"]["value"] is shared
        return step

    padded, shared = first_step(tmp_path / "padded", False), first_step(tmp_path / "shared", True)
    assert shared["reward"] == padded["reward"]  # the same rollout
    for key in ("loss", "grad_norm", "kl"):
        assert shared[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-7), key
