"""sleep_level: whether the native engine releases its KV cache (and CUDA graphs) after each
rollout. Unset, a GPU whose plan fits the update beside the cache keeps it; either way the run
trains the same (new weights still make every cached prefix stale)."""

from __future__ import annotations

import pytest
from helpers.support import recipe

from grpoflow.run.build import build_trainer
from grpoflow.run.chosen_settings import choose_for_run

STANDARD = {
    "model": "random:qwen2-0.5b",
    "gradient_accumulation_steps": 64,
    "max_prompt_length": 128,
    "max_completion_length": 256,
    "per_device_train_batch_size": 8,
}


def chosen(tmp_path, **overrides) -> dict:
    """The run's sleep_level as run.json records it; the config trains with that level."""
    config, settings = choose_for_run(recipe(tmp_path, **{**STANDARD, **overrides}))
    record = settings.record()["sleep_level"]
    assert config.vllm.sleep_level == record["value"]
    return record


def test_a_gpu_with_room_for_the_update_beside_the_cache_keeps_the_cache(tmp_path):
    choice = chosen(tmp_path, gpu_memory_gib=80)
    assert (choice["value"], choice["source"]) == (0, "plan")
    assert "stays through the update" in choice["reason"] and "KV cache" in choice["reason"]


def test_a_gpu_without_that_room_releases_it(tmp_path):
    choice = chosen(tmp_path, gpu_memory_gib=8, gradient_checkpointing=True)
    assert (choice["value"], choice["source"]) == (1, "plan")
    assert "does not fit" in choice["reason"]


def test_a_given_level_stands_and_the_cpu_releases_as_before(tmp_path):
    assert chosen(tmp_path, gpu_memory_gib=80, sleep_level=1) == {
        "value": 1,
        "source": "user",
        "reason": "given",
    }
    assert (chosen(tmp_path)["value"], chosen(tmp_path)["source"]) == (1, "default")
    assert chosen(tmp_path, use_vllm=True, gpu_memory_gib=80)["value"] == 0  # vLLM keeps its memory


def test_a_level_outside_0_to_2_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sleep_level"):
        recipe(tmp_path, sleep_level=3)


def test_keeping_the_cache_trains_exactly_as_releasing_it(tmp_path):
    histories, awake = [], []
    for level in (0, 1):
        trainer = build_trainer(recipe(tmp_path / str(level), sleep_level=level, max_steps=3))
        histories.append([trainer.step() for _ in range(3)])
        awake.append(trainer.source.engine.runner.awake)
    assert awake == [True, False]
    for kept, released in zip(*histories):
        for key in ("loss", "reward", "completions/mean_length"):
            assert kept[key] == released[key], key
