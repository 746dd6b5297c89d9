"""TRL-shaped GRPO scripts, with only the import changed, on a tiny local model on the CPU."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, TrainerCallback

from grpoflow import GRPOConfig, GRPOTrainer
from grpoflow.rewards.registry import REWARD_REGISTRY

TRL_ARGS = dict(
    learning_rate=1e-3,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=4,
    max_steps=2,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    disable_tqdm=True,
    seed=0,
)
"""GRPOConfig fields as a TRL script sets them (each one TRL's GRPOConfig takes)."""


def letters_dataset(conversational: bool = False) -> Dataset:
    prompts = ["ab", "cd", "ef", "gh"]
    if conversational:
        prompts = [[{"role": "user", "content": text}] for text in prompts]
    return Dataset.from_dict({"prompt": prompts, "letter": ["a", "c", "e", "g"]})


class Recorder(TrainerCallback):
    """Records the hooks called, and the logs of on_log; stops after `stop_at` steps when set."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.events: list[str] = []
        self.logs: list[dict] = []
        self.stop_at = stop_at

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append("on_train_begin")
        assert kwargs["model"] is not None and kwargs["processing_class"] is not None

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append("on_step_end")
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append("on_log")
        self.logs.append(dict(logs))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append("on_train_end")


def test_quickstart_script_trains_logs_and_saves_a_full_model(tmp_path, tiny_model_dir):
    seen_letters = []

    def reward_letter(completions, letter, **kwargs):
        seen_letters.extend(letter)
        return [float(c.startswith(target)) for c, target in zip(completions, letter)]

    recorder = Recorder()
    args = GRPOConfig(output_dir=str(tmp_path / "out"), html_report=False, **TRL_ARGS)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_letter,
        args=args,
        train_dataset=letters_dataset(),
        callbacks=[recorder],
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))

    assert set(seen_letters) <= {"a", "c", "e", "g"} and seen_letters
    assert [entry["step"] for entry in trainer.state.log_history] == [1, 2]
    assert trainer.state.global_step == 2
    assert recorder.events[0] == "on_train_begin" and recorder.events[-1] == "on_train_end"
    assert recorder.events.count("on_log") == 2 and recorder.events.count("on_step_end") == 2
    assert "rewards/reward_letter/mean" in recorder.logs[0] and "loss" in recorder.logs[0]
    assert "reward_letter" not in REWARD_REGISTRY  # the script's reward served its run alone
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [
        name
        for (name, after), before in zip(saved.state_dict().items(), start.state_dict().values())
        if not torch.equal(after, before)
    ]
    assert changed  # the trained weights, not the initial ones


def test_lora_script_saves_an_adapter_peft_loads(tmp_path, tiny_model_dir):
    def reward_len(completions, **kwargs):
        return [-abs(4 - len(completion)) for completion in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "out"), html_report=False, **TRL_ARGS)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[reward_len],
        args=args,
        train_dataset=letters_dataset(),
        peft_config=lora,
    )
    assert (trainer.config.adapter.train_type, trainer.config.adapter.lora_rank) == ("lora", 4)
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))

    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter"
    )
    assert loaded.peft_config["default"].r == 4


def test_conversational_prompts_and_a_callback_that_stops_early(tmp_path, tiny_model_dir):
    prompts_seen = []

    def reward_any(prompts, completions, **kwargs):
        prompts_seen.extend(prompts)
        return [float(len(c) > 0) for c in completions]

    recorder = Recorder(stop_at=1)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), html_report=False, **{**TRL_ARGS, "max_steps": 3})
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_any,
        args=args,
        train_dataset=letters_dataset(conversational=True).to_list(),
        callbacks=[recorder],
    )
    trainer.train()

    assert prompts_seen and all(prompt[0]["role"] == "user" for prompt in prompts_seen)
    assert trainer.state.global_step == 1 and len(trainer.state.log_history) == 1
    assert recorder.events.count("on_step_end") == 1 and recorder.events[-1] == "on_train_end"


def test_fields_grpoflow_does_not_implement_are_refused_or_warned_by_name(tmp_path, caplog):
    with pytest.raises(TypeError, match="'learning_rat'.*did you mean learning_rate"):
        GRPOConfig(output_dir=str(tmp_path), learning_rat=1e-6)
    with pytest.raises(TypeError, match="'deepspeed'"):
        GRPOConfig(output_dir=str(tmp_path), deepspeed="ds.json")
    with pytest.raises(ValueError, match="push_to_hub=True is not supported"):
        GRPOConfig(output_dir=str(tmp_path), push_to_hub=True)
    with pytest.raises(ValueError, match="num_generations must be an integer"):
        GRPOConfig(output_dir=str(tmp_path), num_generations="many")
    with caplog.at_level(logging.WARNING, logger="grpoflow.api"):
        args = GRPOConfig(output_dir=str(tmp_path), logging_dir=str(tmp_path / "logs"), bf16=True)
    assert "logging_dir is accepted and not used" in caplog.text
    assert args.to_dict()["torch_dtype"] == "bfloat16" and args.output_dir == str(tmp_path)
    with pytest.raises(ValueError, match="peft_config.use_dora=True"):
        GRPOTrainer(
            model="tiny",
            reward_funcs="echo",
            args=args,
            train_dataset="echo",
            peft_config=LoraConfig(use_dora=True),
        )


def test_trl_and_grpoflow_take_the_same_arguments(tmp_path):
    trl = pytest.importorskip("trl")
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), **TRL_ARGS)
    ours = GRPOConfig(output_dir=str(tmp_path), **TRL_ARGS)
    translated = {"use_cpu", "bf16", "report_to"}
    for name in set(TRL_ARGS) - translated:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.to_dict()["device"] == "cpu" and theirs.use_cpu
    assert [sink for sink in ours.report_to if sink != "none"] == theirs.report_to == []  # no sinks


def test_importing_the_package_loads_neither_torch_nor_the_api():
    code = "import sys, grpoflow; print('torch' in sys.modules, 'grpoflow.api' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_a_loaded_model_trains_and_on_save_follows_the_checkpoints(tmp_path, tiny_model_dir):
    saves = []

    class SaveRecorder(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            saves.append(state.global_step)

    def reward_len(completions, **kwargs):
        return [float(len(completion)) for completion in completions]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        html_report=False,
        **{**TRL_ARGS, "save_strategy": "steps"},
        save_steps=1,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_len,
        args=args,
        train_dataset=letters_dataset(),
        callbacks=[SaveRecorder],
    )
    trainer.train()

    assert saves == [1, 2]
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
    assert trainer.config.policy.model == str(tmp_path / "out" / "initial_model")
