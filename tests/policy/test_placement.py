"""FSDP2 over two CPU processes (gloo) against one unsharded process, and the offload options."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.support import (
    assert_resumed_run_replays,
    clean_env,
    finish,
    free_port,
    grpoflow_train,
    read_jsonl,
    recipe_values,
    weights,
    write_config,
)

from grpoflow.engines import EngineCapabilities
from grpoflow.policy import placement
from grpoflow.policy.offload import CPU, OptimizerOffload, module_offloaded
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model
from grpoflow.run.build import build_trainer, run
from grpoflow.run.config import load_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """4 steps on 2 FSDP ranks of 16 completions each (beta > 0: a sharded reference model too),
    checkpoints at steps 2 and 4."""
    tmp_path = tmp_path_factory.mktemp("fsdp")
    config_path, output_dir = write_config(tmp_path, "run", fsdp=True)
    finish(grpoflow_train(config_path, clean_env(), torchrun=True))
    return output_dir


def test_fsdp_on_two_processes_equals_one_unsharded_process(fsdp_run, tmp_path):
    # The same global batch in the same two micro-batches: same samples, losses and weights to
    # float rounding (the gradient is summed by a reduce-scatter instead of an all-reduce).
    history = run(load_config(None, recipe_values(tmp_path / "run", gradient_accumulation_steps=2)))
    logged = read_jsonl(fsdp_run / "metrics.jsonl")
    assert [row["step"] for row in logged] == [1, 2, 3, 4]
    for expected, got in zip(history, logged, strict=True):
        assert got["reward"] == expected["reward"]
        for key in ("loss", "kl", "grad_norm"):
            assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    single, sharded = weights(tmp_path / "run" / "checkpoint-4"), weights(fsdp_run / "checkpoint-4")
    assert single.keys() == sharded.keys()
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], atol=1e-5, rtol=0, msg=name)
    moved = max(
        (single[name] - weights(tmp_path / "run" / "checkpoint-2")[name]).abs().max() for name in single
    )
    assert moved > 1e-3  # the steps changed the weights: the comparison can fail


@pytest.mark.parametrize(
    "layout, algorithm",
    [
        ({"fsdp_reduce_every_micro_batch": False}, {}),
        ({"fsdp_reshard_after_forward": False}, {}),
        ({"fsdp_reshard_after_forward": False}, {"beta": 0.0, "num_iterations": 1}),
    ],
)
def test_fsdp_update_options_equal_one_unsharded_process(tmp_path, layout, algorithm):
    # Two micro-batches per rank, two optimizer steps per generation batch (num_iterations 2),
    # a sharded reference (beta > 0) and old log-probs: reducing once per step, the first backward
    # of each step keeps full gradients on its rank and the second reduces both; without
    # reshard-after-forward, the layers stay gathered from forward to the step's last backward,
    # and with no pass between (beta 0, one iteration) from the rollout's gather on.
    micro = {"per_device_train_batch_size": 8, "max_steps": 2, **algorithm}
    config_path, output_dir = write_config(
        tmp_path, "fsdp", fsdp=True, gradient_accumulation_steps=2, **layout, **micro
    )
    finish(grpoflow_train(config_path, clean_env(), torchrun=True))
    history = run(load_config(None, recipe_values(tmp_path / "one", gradient_accumulation_steps=4, **micro)))
    logged = read_jsonl(output_dir / "metrics.jsonl")
    for expected, got in zip(history, logged, strict=True):
        for key in ("loss", "kl", "grad_norm") if "kl" in expected else ("loss", "grad_norm"):
            assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    single, sharded = weights(tmp_path / "one" / "checkpoint-2"), weights(output_dir / "checkpoint-2")
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], atol=1e-5, rtol=0, msg=name)


def test_fsdp_resume_replays_the_run_exactly(fsdp_run, tmp_path):
    config_path, output_dir = write_config(
        tmp_path, "resumed", fsdp=True, resume_from_checkpoint=str(fsdp_run / "checkpoint-2")
    )
    finish(grpoflow_train(config_path, clean_env(), torchrun=True))
    assert_resumed_run_replays(fsdp_run, output_dir)


def test_fsdp_with_lora_trains_only_the_adapters_as_one_process_does(tmp_path):
    lora = {"train_type": "lora", "lora_dropout": 0.0, "learning_rate": 1e-2, "max_steps": 2, "save_steps": 2}
    config_path, output_dir = write_config(tmp_path, "fsdp", fsdp=True, **lora)
    finish(grpoflow_train(config_path, clean_env(), torchrun=True))
    history = run(load_config(None, recipe_values(tmp_path / "one", gradient_accumulation_steps=2, **lora)))
    logged = read_jsonl(output_dir / "metrics.jsonl")
    for expected, got in zip(history, logged, strict=True):
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    from safetensors.torch import load_file

    sharded = load_file(str(output_dir / "checkpoint-2" / "adapter_model.safetensors"))
    single = load_file(str(tmp_path / "one" / "checkpoint-2" / "adapter_model.safetensors"))
    assert single.keys() == sharded.keys() and all("lora_" in name for name in single)
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], atol=1e-5, rtol=0, msg=name)


def test_sharded_units_gather_merge_and_restore_as_the_whole_model(tmp_path):
    # rollout_weights (one layer at a time), full_parameters around a forward, optimizer state
    # gathered and scattered, full state dicts; plain, with FSDP's CPU offload, and with LoRA;
    # for an engine that accepts adapters, the unmerged base with the adapters, then the adapters
    # and modules_to_save alone, each tensor gathered by itself (units only when offloaded).
    worker = Path(__file__).parents[1] / "helpers" / "fsdp_worker.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), str(worker)]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "all checks passed" in result.stdout


def test_offload_options_leave_the_run_unchanged(tmp_path):
    options = {"offload_model": True, "offload_optimizer": True, "gc_collect_after_offload": True}
    base = recipe_values(tmp_path / "plain", max_steps=3, save_steps=3, beta=0.05, num_iterations=2)
    plain = run(load_config(None, base))
    config = load_config(None, {**base, "output_dir": str(tmp_path / "offload"), **options})
    trainer = build_trainer(config)
    assert trainer.ref_placement.offload_model and trainer.ref_placement.module is trainer.ref_model
    assert trainer.placement.module is trainer.model and not trainer.placement.is_sharded
    for module in (trainer.model, trainer.ref_model):
        assert not any(isinstance(value, placement.Placement) for value in vars(module).values())
    assert next(trainer.ref_model.parameters()).device == CPU
    offloaded = run(config, trainer)
    for expected, got in zip(plain, offloaded, strict=True):
        assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    want, got = weights(tmp_path / "plain" / "checkpoint-3"), weights(tmp_path / "offload" / "checkpoint-3")
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)


def test_optimizer_state_leaves_for_the_cpu_between_steps_and_returns_for_each():
    parameter = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([parameter], lr=0.1)
    offloader = OptimizerOffload(optimizer)
    seen_in_step = []
    # Registered after the offloader's: sees the state the step is about to use.
    optimizer.register_step_pre_hook(
        lambda *_: seen_in_step.append(optimizer.state[parameter].get("exp_avg"))
    )
    for _ in range(2):
        parameter.grad = torch.full((4,), 0.5)
        optimizer.step()
    state = optimizer.state[parameter]
    assert state["exp_avg"] is not seen_in_step[-1] and state["exp_avg"].device == CPU
    assert offloader.offloaded_bytes == 2 * 4 * 4  # exp_avg and exp_avg_sq, not the step count
    reference = torch.nn.Parameter(torch.ones(4))
    plain = torch.optim.AdamW([reference], lr=0.1)
    for _ in range(2):
        reference.grad = torch.full((4,), 0.5)
        plain.step()
    assert torch.equal(parameter, reference)


class CopyingEngine:
    capabilities = EngineCapabilities(name="copying")
    shares_policy_weights = False


class SharingEngine:
    capabilities = EngineCapabilities(name="sharing")
    shares_policy_weights = True


def test_rollout_context_offloads_the_policy_only_for_an_engine_with_its_own_copy():
    model = build_preset_model("tiny", len(build_char_tokenizer()), seed=0, dtype=torch.float32, device=CPU)
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pointers = [p.data_ptr() for p in model.parameters()]
    where = placement.Placement(module=model, device=CPU, offload_model=True)
    with where.rollout_context(SharingEngine()):
        assert [p.data_ptr() for p in model.parameters()] == pointers
    with where.rollout_context(CopyingEngine()):
        inside = [p.data_ptr() for p in model.parameters()]
    assert all(a != b for a, b in zip(inside, pointers))  # copied out even on a CPU-only machine
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    with module_offloaded(model, CPU) as moved:
        assert moved == sum(p.numel() * 4 for p in model.parameters()) + sum(
            b.numel() * b.element_size() for b in model.buffers()
        )


def tiny(seed: int = 0) -> torch.nn.Module:
    return build_preset_model("tiny", len(build_char_tokenizer()), seed=seed, dtype=torch.float32, device=CPU)


def test_place_models_returns_placements_and_leaves_the_modules_unmarked():
    model, ref_model = tiny(), tiny()
    before = [dict(vars(module)) for module in (model, ref_model)]
    config = placement.PlacementConfig(offload_model=True, gc_collect_after_offload=True)
    where, ref_where = placement.place_models(
        model, ref_model, config, CPU, world_size=1, engine_shares_weights=False
    )
    assert (where.module, where.device, where.offload_model, where.gc_collect) == (model, CPU, True, True)
    assert (ref_where.module, ref_where.offload_model, ref_where.is_sharded) == (ref_model, True, False)
    assert where.full_state_dict() is None and not where.units
    assert [dict(vars(module)) for module in (model, ref_model)] == before
    assert not hasattr(placement, "PLACEMENT_ATTRIBUTE")
    plain, no_ref = placement.place_models(
        model, None, placement.PlacementConfig(), CPU, world_size=1, engine_shares_weights=True
    )
    assert no_ref is None and not plain.offload_model
    assert placement.Placement.local(model).device == CPU


def test_a_replicated_placement_runs_forward_passes_plainly_and_moves_only_an_offloaded_module():
    model = tiny()
    marker = object()
    assert placement.Placement.local(model).sharded_forward(lambda: marker) is marker
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pointers = [p.data_ptr() for p in model.parameters()]
    with placement.Placement.local(model).in_use():
        assert [p.data_ptr() for p in model.parameters()] == pointers
    with placement.Placement(module=model, device=CPU, offload_model=True).in_use():
        inside = [p.data_ptr() for p in model.parameters()]
    assert all(a != b for a, b in zip(inside, pointers))  # brought to its device as a copy
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, original[name]), name


def test_fsdp_needs_a_list_of_decoder_layers():
    with pytest.raises(ValueError, match="fsdp needs the model's list of decoder layers"):
        placement.decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"fsdp_offload_params": True}, "fsdp_offload_params needs fsdp=true"),
        ({"fsdp": True, "offload_model": True}, "offload_model moves a replicated model"),
        ({"fsdp": True, "offload_optimizer": True}, "use fsdp_offload_params=true"),
    ],
)
def test_impossible_memory_layouts_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, recipe_values(tmp_path, **overrides))


def test_fsdp_shards_a_mixture_of_experts_model_and_trains_as_one_process_does(tmp_path):
    # Each rank holds half of every layer's experts (the fused expert parameters are sharded on
    # their first dimension, the experts); the routing the engine recorded is replayed on both.
    moe = {"model": "random:tiny-moe", "max_steps": 2, "save_steps": 2, "learning_rate": 1e-2}
    config_path, output_dir = write_config(tmp_path, "fsdp", fsdp=True, **moe)
    finish(grpoflow_train(config_path, clean_env(), torchrun=True))
    history = run(load_config(None, recipe_values(tmp_path / "one", gradient_accumulation_steps=2, **moe)))
    logged = read_jsonl(output_dir / "metrics.jsonl")
    for expected, got in zip(history, logged, strict=True):
        assert got["reward"] == expected["reward"]
        assert got["routing/mismatch_fraction"] == 0.0
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    single, sharded = weights(tmp_path / "one" / "checkpoint-2"), weights(output_dir / "checkpoint-2")
    assert any(".experts." in name for name in single)
    for name in single:
        torch.testing.assert_close(sharded[name], single[name], atol=1e-5, rtol=0, msg=name)
