"""sleep_level: whether the native engine releases its KV cache (and CUDA graphs) after each
rollout. Unset, a GPU whose plan fits the update beside the cache keeps it; either way the run
trains the same (new weights still make every cached prefix stale)."""

from __future__ import annotations

import pytest
from helpers.support import recipe

from grpoflow.run.build import build_trainer
from grpoflow.run.chosen_settings import choose_for_run
from grpoflow.run.plan_check import check_plan, run_plan

GIB = 2**30

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
    on_cpu = chosen(tmp_path, device="cpu")  # wherever the suite runs
    assert (on_cpu["value"], on_cpu["source"]) == (1, "default")
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


def test_a_kept_cache_is_planned_into_the_update_and_refused_when_it_does_not_fit(tmp_path):
    # The update's peak holds the cache at sleep_level 0 and not at 1; a GPU with room for the
    # update alone refuses the kept cache, naming sleep_level.
    plans = {
        level: run_plan(
            recipe(tmp_path / str(level), **STANDARD, gpu_memory_gib=80, sleep_level=level), 80 * GIB
        )[0]
        for level in (0, 1)
    }
    cache = plans[0].rollout["kv_cache"]
    assert plans[0].update["kv_cache"] == cache > GIB and "kv_cache" not in plans[1].update
    assert sum(plans[0].update.values()) == sum(plans[1].update.values()) + cache
    room = (sum(plans[1].update.values()) + cache / 2) / GIB
    check_plan(recipe(tmp_path / "a", **STANDARD, gpu_memory_gib=room, sleep_level=1))
    with pytest.raises(ValueError, match="sleep_level 1"):
        check_plan(recipe(tmp_path / "b", **STANDARD, gpu_memory_gib=room, sleep_level=0))
