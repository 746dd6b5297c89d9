"""The settings chosen from the memory plan, with the device's facts as numbers: checkpointing off
and the micro-batch raised while the plan fits with a margin, compile where Inductor compiles,
every given setting kept, and nothing planned on the CPU."""

from __future__ import annotations

import dataclasses

import pytest

from grpoflow.policy.auto_settings import (
    DEFAULT_MICRO_BATCH,
    DeviceFacts,
    UserSettings,
    choose_settings,
    micro_batch_candidates,
)
from grpoflow.policy.memory_plan import GIB, ModelShape, PlanSettings, plan_memory
from grpoflow.policy.tiny import PRESETS

QWEN_05B = ModelShape(
    **{key: value for key, value in PRESETS["qwen2-0.5b"].items() if key != "max_position_embeddings"},
    tie_word_embeddings=True,
)
BASE = PlanSettings(sequence_length=384)
STANDARD = UserSettings(generation_batch=512)
"""The standard workload's 512 completions of 128 + 256 tokens a step, every setting unset."""


def h100(compiles: bool = True) -> DeviceFacts:
    return DeviceFacts("cuda", 80 * GIB, compile_available=compiles)


def test_an_h100_gets_the_fast_settings_for_the_standard_workload():
    chosen = choose_settings(QWEN_05B, BASE, h100(), STANDARD)
    assert (chosen.gradient_checkpointing, chosen.micro_batch_size, chosen.torch_compile) == (False, 64, True)
    assert set(chosen.sources.values()) == {"plan", "default"}
    assert chosen.peak_bytes <= 0.8 * 80 * GIB
    line = chosen.describe()
    assert "gradient_checkpointing=False, per_device_train_batch_size=64, torch_compile=True" in line
    assert "of 80.0 GiB" in line and "override" in line


def test_a_small_gpu_keeps_checkpointing_and_the_micro_batch_that_fit():
    chosen = choose_settings(QWEN_05B, BASE, DeviceFacts("cuda", 6 * GIB, compile_available=False), STANDARD)
    assert (chosen.gradient_checkpointing, chosen.micro_batch_size, chosen.torch_compile) == (True, 8, False)
    mid = choose_settings(QWEN_05B, BASE, DeviceFacts("cuda", 16 * GIB), STANDARD)
    assert not mid.gradient_checkpointing and mid.micro_batch_size == DEFAULT_MICRO_BATCH
    bigger = plan_memory(QWEN_05B, PlanSettings(sequence_length=384, micro_batch_size=16), 16 * GIB)
    assert bigger.peak > 0.8 * 16 * GIB  # the next micro-batch would not have fitted


def test_given_settings_win():
    user = UserSettings(
        generation_batch=512, gradient_checkpointing=True, micro_batch_size=32, torch_compile=False
    )
    chosen = choose_settings(QWEN_05B, BASE, h100(), user)
    assert (chosen.gradient_checkpointing, chosen.micro_batch_size, chosen.torch_compile) == (True, 32, False)
    assert chosen.sources["per_device_train_batch_size"] == "user" and chosen.describe() is None
    only_micro_batch = choose_settings(
        QWEN_05B, BASE, h100(), UserSettings(generation_batch=512, micro_batch_size=32)
    )
    assert only_micro_batch.micro_batch_size == 32 and not only_micro_batch.gradient_checkpointing


def test_the_cpu_plans_nothing_and_keeps_the_defaults():
    chosen = choose_settings(None, None, DeviceFacts("cpu"), STANDARD)
    assert (chosen.gradient_checkpointing, chosen.micro_batch_size, chosen.torch_compile) == (False, 8, False)
    assert set(chosen.sources.values()) == {"default"} and chosen.describe() is None
    record = chosen.record()
    assert record["per_device_train_batch_size"] == {"value": 8, "source": "default"}


def test_micro_batches_divide_the_generation_batch_and_keep_the_loss():
    assert micro_batch_candidates(UserSettings(generation_batch=48), 100) == [8, 16, 24, 48]
    assert micro_batch_candidates(UserSettings(generation_batch=512), 384) == [8, 16, 32, 64, 128]
    bnpo = UserSettings(generation_batch=512, loss_reads_micro_batches=True)
    assert choose_settings(QWEN_05B, BASE, h100(), bnpo).micro_batch_size == DEFAULT_MICRO_BATCH


@pytest.mark.parametrize("given_tokens", [None, 4096])
def test_padding_free_gets_a_token_budget_of_the_chosen_micro_batch(given_tokens):
    user = UserSettings(generation_batch=512, padding_free=True, max_tokens_per_micro_batch=given_tokens)
    chosen = choose_settings(QWEN_05B, BASE, h100(), user)
    assert chosen.max_tokens_per_micro_batch == (given_tokens or 64 * 384)
    assert chosen.sources["max_tokens_per_micro_batch"] == ("user" if given_tokens else "plan")


def test_a_mixture_of_experts_model_stays_eager_unless_compile_is_asked_for():
    moe = dataclasses.replace(
        QWEN_05B, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, num_moe_layers=24
    )
    assert choose_settings(QWEN_05B, BASE, h100(), STANDARD).torch_compile
    assert not choose_settings(moe, BASE, h100(), STANDARD).torch_compile
    asked = UserSettings(generation_batch=512, torch_compile=True)
    assert choose_settings(moe, BASE, h100(), asked).torch_compile


def test_the_batch_invariant_kernels_stay_eager():
    """Compiling would fuse the elementwise steps between the kernels and change their rounding."""
    kernels = UserSettings(generation_batch=512, batch_invariant=True)
    assert not choose_settings(QWEN_05B, BASE, h100(), kernels).torch_compile
