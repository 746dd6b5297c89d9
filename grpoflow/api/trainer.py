"""`GRPOTrainer(model, reward_funcs, args, train_dataset, ...)`: TRL's trainer, over grpoflow's run.

The arguments become the options of one run (`grpoflow.api.inputs`), built and trained as
`grpoflow train` builds and trains a recipe's (`grpoflow.run.build`); `train` runs it with the
callbacks following its steps, `save_model` writes the policy in the Hugging Face layout (the
adapter alone for LoRA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import TrainOutput

from grpoflow.api.callbacks import Callbacks, TrainingStopped
from grpoflow.api.config import GRPOConfig
from grpoflow.api.inputs import (
    dataset_file,
    lora_options,
    model_option,
    object_options,
    unsupported_arguments,
)
from grpoflow.api.rewards import reward_options
from grpoflow.imports import provided_for_now
from grpoflow.policy.lora import is_peft_model
from grpoflow.rewards.registry import registered_for_now
from grpoflow.run.build import build_trainer, run
from grpoflow.run.config import GRPOConfig as RunConfig
from grpoflow.run.trainer import GRPOTrainer as Loop


class GRPOTrainer:
    """A GRPO run taking TRL's GRPOTrainer arguments; `config` is the run's config tree."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[TrainerCallback | type[TrainerCallback]] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ) -> None:
        unsupported_arguments(optimizers, quantization_config)
        self.args = args if args is not None else GRPOConfig()
        output_dir = self.args.output_dir
        values: dict[str, Any] = {
            "model": model_option(model, processing_class, output_dir),
            **lora_options(peft_config),
        }
        rewards, self._reward_functions = reward_options(
            reward_funcs, reward_processing_classes, output_dir, self.args.reward_weights
        )
        values.update(rewards)
        if train_dataset is not None:
            values["dataset"] = [dataset_file(train_dataset, output_dir, "train_dataset")]
        if eval_dataset is not None:
            values["eval_dataset"] = [dataset_file(eval_dataset, output_dir, "eval_dataset")]
        code, self._objects = object_options(
            {"rollout_func": rollout_func, "tools": tools, "environment_factory": environment_factory}
        )
        values.update(code)
        self._values = values
        self.config: RunConfig = self.args.to_run_config(**values)
        self.callback_handler = Callbacks(callbacks or [], self.args)
        self._loop: Loop | None = None

    @contextlib.contextmanager
    def _script_code(self) -> Iterator[None]:
        """While the run is built: the script's reward functions registered, and its tools, rollout
        function and environment factories provided under their import paths."""
        with registered_for_now(self._reward_functions), provided_for_now(self._objects):
            yield

    @property
    def state(self):
        """transformers' `TrainerState`: global_step, max_steps, log_history."""
        return self.callback_handler.state

    @property
    def control(self):
        return self.callback_handler.control

    @property
    def model(self) -> torch.nn.Module | None:
        """The policy (a PEFT model under LoRA) once `train` built it; None before."""
        return self._loop.model if self._loop is not None else None

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.callback_handler.callbacks.append(callback() if isinstance(callback, type) else callback)

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Build the run and train it to max_steps (or num_train_epochs), or until a callback
        stops it. `resume_from_checkpoint`: a checkpoint directory, or True for the latest in
        output_dir."""
        config = self.config
        if resume_from_checkpoint:
            resume = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
            config = self.args.to_run_config(**self._values, resume_from_checkpoint=resume)
        with self._script_code():
            self._loop = loop = build_trainer(config)
        handler = self.callback_handler
        objects = {
            "model": loop.model,
            "processing_class": loop.tokenizer,
            "optimizer": loop.optimizer,
            "lr_scheduler": loop.learner.scheduler,
        }
        handler.start(
            total_steps=loop.total_steps,
            objects=objects,
            saves_at=lambda step: loop.checkpoints.is_due(step, loop.total_steps),
        )
        try:
            history = run(config, loop, handler)
        except TrainingStopped:
            history = []
        handler.event("on_train_end")
        losses = [step["loss"] for step in history if "loss" in step]
        last = self.state.log_history[-1] if self.state.log_history else {}
        return TrainOutput(loop.step_count, sum(losses) / len(losses) if losses else 0.0, last)

    def save_model(self, output_dir: str | None = None) -> Path:
        """Write the policy to `output_dir` (default: args.output_dir) as `save_pretrained` does,
        with its tokenizer: the full model, or the adapter alone for LoRA (load it with PEFT)."""
        loop = self._loop
        if loop is None:
            raise ValueError("save_model: there is no trained model yet; call trainer.train() first")
        target = Path(output_dir or self.args.output_dir)
        weights = loop.placement.full_state_dict()  # every rank takes part under FSDP
        if loop.distributed.is_main:
            model = loop.placement.module
            extra = {"save_embedding_layers": False} if is_peft_model(model) else {}
            model.save_pretrained(target, state_dict=weights, **extra)
            loop.tokenizer.save_pretrained(target)
        loop.distributed.barrier()
        return target
