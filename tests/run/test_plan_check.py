"""The run's memory plan: `grpoflow plan` and the check before `grpoflow train` loads anything."""

from __future__ import annotations

import pytest
from helpers.support import recipe

from grpoflow.cli import main
from grpoflow.policy import memory_plan
from grpoflow.run.build import build_trainer
from grpoflow.run.plan_check import check_plan, kv_cache_blocks, model_shape, plan_settings, run_plan


def test_plan_prints_a_table_without_loading_weights(capsys):
    code = main(["plan", "--config", "default", "--model", "random:qwen2-0.5b", "--gpu_memory_gib", "80"])
    out = capsys.readouterr().out
    assert code == 0 and "weights" in out and "fits" in out and "of 80.00 GiB" in out


def test_train_refuses_a_plan_that_does_not_fit(tmp_path):
    config = recipe(tmp_path, model="random:qwen2-0.5b", gpu_memory_gib=1.0)
    with pytest.raises(ValueError, match="per_device_train_batch_size") as error:
        build_trainer(config)
    assert "largest parts" in str(error.value) and "memory_check" in str(error.value)


def test_memory_check_off_and_cpu_runs_plan_nothing(tmp_path):
    assert (
        check_plan(recipe(tmp_path, model="random:qwen2-0.5b", gpu_memory_gib=1.0, memory_check="off"))
        is None
    )
    assert check_plan(recipe(tmp_path)) is None  # no GPU, no override


def test_kv_cache_takes_what_the_plan_leaves(tmp_path):
    small = run_plan(
        recipe(tmp_path, model="random:qwen2-0.5b", max_completion_length=8192, gpu_memory_utilization=0.3),
        20 * 2**30,
    )
    large = run_plan(
        recipe(tmp_path, model="random:qwen2-0.5b", max_completion_length=8192, gpu_memory_utilization=0.9),
        20 * 2**30,
    )
    assert 0 < small[1] < large[1]


def test_the_peak_counts_the_workspace_the_runs_calls_use(tmp_path):
    from grpoflow.engines.native.sizing import NativeEngineConfig
    from grpoflow.run.plan_check import engine_in_use

    bounds = NativeEngineConfig(max_num_seqs=512, max_prefill_tokens=16384)
    # 16 prompts x 8 samples a step, prompts of at most 128 tokens: 128 rows, 16 x 128 tokens
    config = recipe(
        tmp_path,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=8,
        num_generations=8,
        max_prompt_length=128,
    )
    used = engine_in_use(config, bounds)
    assert (used.max_num_seqs, used.max_prefill_tokens) == (128, 16 * 128)
    episodes = recipe(tmp_path, tools=["grpoflow.tasks.calculator:calculate"])
    assert engine_in_use(episodes, bounds) is bounds  # turns re-prefill their context: the bounds


def test_the_cache_holds_what_the_runs_calls_decode_at_once(tmp_path):
    # A single-turn run decodes its generation batch at once: 16 prompts x 8, 384 tokens each in
    # blocks of 32, however much memory is left; episodes keep max_num_seqs full sequences.
    base = {
        "model": "random:qwen2-0.5b",
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 8,
        "max_prompt_length": 128,
        "max_completion_length": 256,
        "max_num_seqs": 512,
    }
    shape = model_shape(recipe(tmp_path, **base), on_gpu=True)
    blocks, _ = kv_cache_blocks(recipe(tmp_path, **base), shape, 80 * 2**30)
    assert blocks == 128 * 12
    episodes = recipe(tmp_path, **base, tools=["grpoflow.tasks.calculator:calculate"])
    assert kv_cache_blocks(episodes, shape, 80 * 2**30)[0] == 512 * 12


def test_a_colocated_vllm_holds_its_share_beside_the_trainer(tmp_path):
    # vLLM allocates vllm_gpu_memory_utilization of the GPU for itself: through the update at its
    # default sleep_level 0, for rollouts only at 1; the settings chosen leave it that share.
    from grpoflow.policy.auto_settings import DeviceFacts
    from grpoflow.run.chosen_settings import choose

    gib = 2**30
    base = {"model": "random:qwen2-0.5b", "gradient_accumulation_steps": 64, "max_completion_length": 256}
    vllm = {**base, "use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}
    plan, blocks = run_plan(recipe(tmp_path / "kept", **vllm), 80 * gib)
    assert blocks is None and plan.rollout["vllm"] == plan.update["vllm"] == int(0.3 * 80 * gib)
    slept, _ = run_plan(recipe(tmp_path / "slept", **vllm, sleep_level=1), 80 * gib)
    assert slept.rollout["vllm"] == plan.rollout["vllm"] and "vllm" not in slept.update
    gpu = DeviceFacts("cuda", 16 * gib, True)
    native = choose(recipe(tmp_path / "native", **base), gpu)
    colocated = choose(recipe(tmp_path / "colocated", **vllm), gpu)
    assert not native.gradient_checkpointing and colocated.gradient_checkpointing
    with pytest.raises(ValueError, match="lower vllm_gpu_memory_utilization"):
        check_plan(
            recipe(tmp_path / "full", **{**vllm, "vllm_gpu_memory_utilization": 0.9}, gpu_memory_gib=24)
        )


def test_the_config_decides_what_fsdp_accumulates_and_the_optimizer_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = {"model": "random:qwen2-0.5b", "fsdp": True, "torch_dtype": "bfloat16"}
    settings = {
        name: plan_settings(recipe(tmp_path / name, **base, **values), dtype_bytes=2)
        for name, values in {
            "every": {},
            "once": {"fsdp_reduce_every_micro_batch": False},
            "once_no_mixed": {"fsdp_reduce_every_micro_batch": False, "fsdp_mixed_precision": "no"},
            "foreach": {"optim": "adamw_torch"},
            "kept": {"fsdp_reshard_after_forward": False},
        }.items()
    }
    assert settings["every"].accumulated_gradient_bytes == 0 and settings["every"].fsdp_world_size == 2
    assert settings["once"].accumulated_gradient_bytes == 4  # float32, the reduce dtype
    assert settings["once_no_mixed"].accumulated_gradient_bytes == 2  # the weights' dtype
    assert settings["foreach"].optimizer_temporaries and not settings["every"].optimizer_temporaries
    assert settings["every"].fsdp_reshard_after_forward and not settings["kept"].fsdp_reshard_after_forward


def test_the_native_engine_leaves_room_for_its_fused_copies_under_fsdp(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    base = {"model": "random:qwen2.5-7b", "fsdp": True, "torch_dtype": "bfloat16", "gpu_memory_gib": 48}
    config = recipe(tmp_path / "native", **base)
    assert plan_settings(config).fused_copies
    assert not plan_settings(recipe(tmp_path / "hf", **base, rollout_engine="hf")).fused_copies
    shape = model_shape(config, on_gpu=True)
    blocks, _ = kv_cache_blocks(config, shape, 48 * 2**30)
    monkeypatch.setattr(memory_plan, "fused_copy_bytes", lambda shape: 0)  # as if it made none
    room, _ = kv_cache_blocks(config, shape, 48 * 2**30)
    per_block = 2 * 28 * 4 * 128 * 2 * 16  # keys and values of 16 tokens, 28 layers, 4 heads of 128
    assert blocks > 0 and room - blocks == pytest.approx(
        memory_plan.fused_copy_bytes(shape) / per_block, abs=1
    )


FSDP_7B = {
    "model": "random:qwen2.5-7b",
    "fsdp": True,
    "torch_dtype": "bfloat16",
    "gradient_checkpointing": True,
}
LAYOUT = ("fsdp_reshard_after_forward", "fsdp_reduce_every_micro_batch")


def test_an_fsdp_runs_layout_left_unset_is_chosen_from_the_room_the_plan_leaves(tmp_path, monkeypatch):
    from grpoflow.run.chosen_settings import choose_for_run
    from grpoflow.run.plan_check import choose_fsdp_layout

    monkeypatch.setenv("WORLD_SIZE", "2")

    def layout(name, **options):
        config = recipe(tmp_path / name, **FSDP_7B, per_device_train_batch_size=16, **options)
        return choose_fsdp_layout(config)

    # 140 GiB: both faster; 80: the full float32 gradients do not fit beside the gathered weights
    roomy, h100 = layout("roomy", gpu_memory_gib=140), layout("h100", gpu_memory_gib=80)
    assert roomy.values == dict.fromkeys(LAYOUT, False) and roomy.source == "plan"
    assert h100.values == {LAYOUT[0]: False, LAYOUT[1]: True} and "would not" in h100.reason
    tight = layout("tight", gpu_memory_gib=45)
    assert tight.values == dict.fromkeys(LAYOUT, True) and "exceeds 36.0 GiB" in tight.reason
    unplanned = layout("off", gpu_memory_gib=140, memory_check="off")
    assert unplanned.values == dict.fromkeys(LAYOUT, True) and unplanned.source == "default"
    given = layout("given", gpu_memory_gib=140, fsdp_reshard_after_forward=True)
    assert given.values == {LAYOUT[1]: False}  # the setting given is kept, the other chosen
    assert layout("both", gpu_memory_gib=140, **dict.fromkeys(LAYOUT, True)) is None
    config, chosen = choose_for_run(recipe(tmp_path / "run", **FSDP_7B, gpu_memory_gib=140))
    assert config.placement.fsdp_reshard_after_forward is False
    assert chosen.record()[LAYOUT[1]]["source"] == "plan"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert layout("single", gpu_memory_gib=140) is None
    assert choose_for_run(recipe(tmp_path / "one", **FSDP_7B, gpu_memory_gib=140))[1].fsdp_layout == {}


def test_fsdp_runs_hear_of_a_faster_layout_they_set_otherwise_when_its_memory_fits(
    tmp_path, monkeypatch, caplog
):
    from grpoflow.run.plan_check import faster_fsdp_layout

    monkeypatch.setenv("WORLD_SIZE", "2")
    slower = dict.fromkeys(LAYOUT, True)
    config = recipe(tmp_path / "a", **FSDP_7B, **slower, per_device_train_batch_size=16)
    hint = faster_fsdp_layout(config, 120 * 2**30)
    assert "fsdp_reshard_after_forward: false" in hint and "fsdp_reduce_every_micro_batch: false" in hint
    assert "fsdp_mixed_precision: no" in hint  # bf16 weights trained in full reduce in bf16
    with caplog.at_level("INFO", logger="grpoflow"):
        check_plan(
            recipe(tmp_path / "b", **FSDP_7B, **slower, gpu_memory_gib=120, per_device_train_batch_size=16)
        )
    assert "faster FSDP layout" in caplog.text
    # Left unset (the plan chooses them), already set, or no room: only what is left to say.
    unset = recipe(tmp_path / "c", **FSDP_7B, per_device_train_batch_size=16)
    assert "fsdp_mixed_precision: no (" in faster_fsdp_layout(unset, 120 * 2**30)
    set_already = recipe(tmp_path / "d", **FSDP_7B, **dict.fromkeys(LAYOUT, False), fsdp_mixed_precision="no")
    assert faster_fsdp_layout(set_already, 120 * 2**30) is None
    assert faster_fsdp_layout(config, 40 * 2**30) is None
    lora = recipe(tmp_path / "e", **FSDP_7B, **slower, train_type="lora")
    assert "fsdp_mixed_precision" not in faster_fsdp_layout(lora, 120 * 2**30)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert faster_fsdp_layout(config, 120 * 2**30) is None


def test_a_cache_too_small_for_the_step_is_named_with_its_fix(tmp_path, caplog):
    from grpoflow.run.plan_check import completions_held, few_rows_warning

    # 8 prompts x 8 samples, prompts of 128 tokens (4 blocks of 32, shared by a group), 256 new
    # tokens (8 blocks): 8.5 blocks a completion at its longest
    values = dict(
        model="random:qwen2-0.5b",
        per_device_train_batch_size=16,
        gradient_accumulation_steps=4,
        num_generations=8,
        max_prompt_length=128,
        max_completion_length=256,
        gpu_memory_utilization=0.3,
    )
    config = recipe(tmp_path, **values)
    assert completions_held(config, 170) == 20 and completions_held(config, 10**6) == 512
    warning = few_rows_warning(config, 170)
    assert "holds about 20 of the 64 completions" in warning and "4 waves" in warning
    assert "gpu_memory_utilization (now 0.3)" in warning
    assert few_rows_warning(config, 544) is None
    capped = recipe(tmp_path, **{**values, "max_num_seqs": 32})
    assert few_rows_warning(capped, 10**6) == (
        "max_num_seqs (32) is below the 64 completions a step generates: the rollout decodes them in "
        "about 2 waves; raise it"
    )
    with caplog.at_level("WARNING", logger="grpoflow"):
        check_plan(recipe(tmp_path, model="random:qwen2.5-7b", gpu_memory_gib=80, gpu_memory_utilization=0.3))
    assert "raise gpu_memory_utilization" in caplog.text
