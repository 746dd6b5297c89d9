"""TRL GRPOConfig fields users commonly set, as grpoflow's options, or refused with why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from grpoflow import GRPOConfig
from grpoflow.run.build import build_optimizer
from grpoflow.run.config import load_config

RUN = {"model": "tiny", "dataset": ["echo"], "reward_funcs": ["echo"]}
"""What a trainer adds to the config's fields (model, prompts, reward)."""


def run_config(tmp_path, **fields):
    return GRPOConfig(output_dir=str(tmp_path), **fields).to_run_config(**RUN)


def warmup_of(config, optimizer_steps: int = 10) -> list[float]:
    """The schedule's learning-rate factor at the first 6 optimizer steps of a run of `optimizer_steps`."""
    _, scheduler = build_optimizer(torch.nn.Linear(2, 2), config, optimizer_steps)
    return [round(scheduler.lr_lambdas[0](step), 3) for step in range(6)]


def test_warmup_steps_is_a_number_of_steps_or_a_fraction_below_one(tmp_path):
    assert warmup_of(run_config(tmp_path, warmup_steps=4, lr_scheduler_type="constant_with_warmup")) == [
        0.0, 0.25, 0.5, 0.75, 1.0, 1.0,
    ]  # fmt: skip
    fraction = run_config(tmp_path, warmup_steps=0.2, lr_scheduler_type="constant_with_warmup")
    assert fraction.training.warmup_ratio == 0.2
    assert warmup_of(fraction) == [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]
    flag = load_config(None, {**RUN, "warmup_steps": "2", "lr_scheduler_type": "constant_with_warmup"})
    assert warmup_of(flag)[:3] == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="warmup_steps must be 0 when warmup_ratio is set"):
        run_config(tmp_path, warmup_steps=2, warmup_ratio=0.1)
    with pytest.raises(ValueError, match="warmup_steps must be a whole number"):
        GRPOConfig(warmup_steps=2.5)


def test_model_init_kwargs_set_the_model_options_and_other_keys_are_refused(tmp_path):
    config = run_config(
        tmp_path,
        model_init_kwargs={
            "dtype": torch.bfloat16,
            "attn_implementation": "eager",
            "trust_remote_code": True,
        },
    )
    policy = config.policy
    assert (policy.torch_dtype, policy.attn_implementation, policy.trust_remote_code) == (
        "bfloat16", "eager", True,
    )  # fmt: skip
    assert run_config(tmp_path, model_init_kwargs={"torch_dtype": "float16"}).policy.torch_dtype == "float16"
    with pytest.raises(ValueError, match=r"model_init_kwargs\['device_map'\] is not supported"):
        GRPOConfig(model_init_kwargs={"device_map": "auto"})


def test_gradient_checkpointing_kwargs_take_use_reentrant_alone(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="grpoflow.api"):
        config = run_config(
            tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}
        )
    assert config.policy.gradient_checkpointing and "use_reentrant=False" in caplog.text
    run_config(tmp_path, gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(
        ValueError, match=r"gradient_checkpointing_kwargs\['every_n_layers'\] is not supported"
    ):
        GRPOConfig(gradient_checkpointing_kwargs={"every_n_layers": 2})


def test_a_generation_batch_is_taken_where_it_is_grpoflows(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    batch = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
    GRPOConfig(steps_per_generation=2, generation_batch_size=8, **batch)
    with pytest.raises(ValueError, match="steps_per_generation=4 is not supported: grpoflow generates"):
        GRPOConfig(steps_per_generation=4, **batch)
    with pytest.raises(ValueError, match="generation_batch_size=32 is not supported over 1 process"):
        GRPOConfig(generation_batch_size=32, **batch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    GRPOConfig(generation_batch_size=16, **batch)


def test_tf32_is_set_for_the_process_as_transformers_sets_it():
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        GRPOConfig(tf32=True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        GRPOConfig(tf32=False)
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_upload_fields_are_refused_only_where_they_would_upload(tmp_path, caplog):
    GRPOConfig(hub_strategy="every_save", hub_token=None, hub_always_push=False)
    for field, value in {"hub_model_id": "me/model", "hub_strategy": "end", "hub_private_repo": True}.items():
        with pytest.raises(ValueError, match=f"{field}=.* is not supported: grpoflow does not upload"):
            GRPOConfig(**{field: value})


def test_fields_of_no_effect_here_are_accepted_with_a_warning_and_shuffle_dataset_is_mapped(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="grpoflow.api"):
        config = run_config(
            tmp_path, dataloader_drop_last=True, label_names=["labels"], shuffle_dataset=False
        )
    assert "dataloader_drop_last is accepted and not used" in caplog.text
    assert "label_names is accepted and not used" in caplog.text
    assert config.data.dataset_shuffle is False


def test_refused_fields_say_why(tmp_path):
    with pytest.raises(TypeError, match="'lr_scheduler_kwarg'.*did you mean lr_scheduler_kwargs"):
        GRPOConfig(lr_scheduler_kwarg={})
    with pytest.raises(ValueError, match="lr_scheduler_kwargs=.* is not supported: grpoflow's schedules"):
        GRPOConfig(lr_scheduler_kwargs={"num_cycles": 2})
    with pytest.raises(ValueError, match="optim_args='betas=.*' is not supported: grpoflow's AdamW"):
        GRPOConfig(optim_args="betas=(0.9,0.95)")
    with pytest.raises(TypeError, match="'deepspeed' is not supported: grpoflow runs data-parallel or FSDP"):
        GRPOConfig(deepspeed="ds.json")


def test_a_dataset_given_as_rows_is_written_whole_and_leaves_no_partial_file(tmp_path):
    from grpoflow.api.inputs import dataset_file

    path = dataset_file([{"prompt": "ab"}, {"prompt": "cd"}], str(tmp_path), "train_dataset")
    assert Path(path).read_text().splitlines() == ['{"prompt": "ab"}', '{"prompt": "cd"}']
    with pytest.raises(ValueError, match="row 1"):
        dataset_file([{"prompt": "ab"}, {"prompt": object()}], str(tmp_path), "train_dataset")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train_dataset.jsonl"]  # the bad write left nothing
    assert Path(path).read_text().count("\n") == 2  # and the earlier file stands
