"""`GRPOTrainer(model, reward_funcs, args, train_dataset, ...)`: TRL's trainer, over grpoflow's run.

The arguments become the options of one run (`grpoflow.api.inputs`), built and trained by
`grpoflow.run.build`; `grpoflow train` trains a recipe's run through this trainer too
(`from_run_config`). `train` runs it with the callbacks following its steps, `evaluate` evaluates
its policy with the run's own evaluation (`grpoflow.run.evaluation`), `save_model` writes the
policy in the Hugging Face layout (the adapter alone for LoRA).
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
from grpoflow.report.run_files import METRICS_FILE, read_metrics
from grpoflow.rewards.registry import registered_for_now
from grpoflow.run.build import build_trainer, eval_prompts, run
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
        self._start(self.args, self.args.to_run_config(**values), values, callbacks)

    def _start(
        self,
        args: GRPOConfig,
        config: RunConfig,
        values: dict[str, Any],
        callbacks: list[TrainerCallback | type[TrainerCallback]] | None,
    ) -> None:
        self.args, self.config, self._values = args, config, values
        self.callback_handler = Callbacks(callbacks or [], args)
        self.run_history: list[dict[str, float]] = []
        """Every step's metrics of the last `train` (logged or not)."""
        self._loop: Loop | None = None
        self._run_config = config
        self._ran = False
        """Whether the built run has trained (and so closed its services)."""

    @classmethod
    def from_run_config(
        cls, config: RunConfig, callbacks: list[TrainerCallback | type[TrainerCallback]] | None = None
    ) -> GRPOTrainer:
        """A trainer of a run's config tree as it is (a recipe's, `grpoflow train`'s)."""
        trainer = cls.__new__(cls)
        trainer._reward_functions, trainer._objects = {}, {}
        trainer._start(GRPOConfig.from_run_config(config), config, {}, callbacks)
        return trainer

    @contextlib.contextmanager
    def _script_code(self) -> Iterator[None]:
        """While the run is built: the script's reward functions registered, and its tools, rollout
        function and environment factories provided under their import paths."""
        with registered_for_now(self._reward_functions), provided_for_now(self._objects):
            yield

    @property
    def state(self):
        """transformers' `TrainerState`: global_step, max_steps, epoch, log_history, best_metric."""
        return self.callback_handler.state

    @property
    def control(self):
        return self.callback_handler.control

    @property
    def model(self) -> torch.nn.Module | None:
        """The policy (a PEFT model under LoRA) once the run is built; None before."""
        return self._loop.model if self._loop is not None else None

    @property
    def loop(self) -> Loop | None:
        """The run's training loop once built (`build`, `train`, `evaluate`); None before."""
        return self._loop

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.callback_handler.callbacks.append(callback() if isinstance(callback, type) else callback)

    def build(self, resume_from_checkpoint: str | bool | None = None) -> Loop:
        """Build the run now, as `train` and `evaluate` do when they need it: the model, data,
        rewards and engine loaded and every setting checked (a ValueError names what is wrong).
        `resume_from_checkpoint`: a checkpoint directory, or True for the latest in output_dir."""
        if self._loop is not None and not self._ran:
            self._loop.close()
        config = self.config
        if resume_from_checkpoint:
            resume = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
            config = self.args.to_run_config(**self._values, resume_from_checkpoint=resume)
        with self._script_code():
            self._loop = loop = build_trainer(config)
        self._run_config, self._ran = config, False
        self.callback_handler.objects = {
            "model": loop.model,
            "processing_class": loop.tokenizer,
            "optimizer": loop.optimizer,
            "lr_scheduler": loop.learner.scheduler,
        }
        return loop

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train the run to max_steps (or num_train_epochs), or until a callback stops it; it is
        built first unless `build` or `evaluate` built it. `resume_from_checkpoint`: a checkpoint
        directory, or True for the latest in output_dir (the state's log_history continues the
        run's)."""
        loop = self._loop
        if loop is None or self._ran or resume_from_checkpoint:
            loop = self.build(resume_from_checkpoint)
        handler = self.callback_handler
        handler.start(
            total_steps=loop.total_steps,
            saves_at=lambda step: loop.checkpoints.is_due(step, loop.total_steps),
            steps_per_epoch=loop.settings.steps_per_epoch,
            step=loop.step_count,
            history=self._logged_so_far(loop),
            rank=(loop.distributed.is_main, loop.distributed.local_rank == 0),
            any_rank=lambda flag: loop.distributed.max_int(int(flag)) > 0,
        )
        self._ran, self.run_history = True, []
        with contextlib.suppress(TrainingStopped):  # a callback stopped it: the run ends there
            self.run_history = run(self._run_config, loop, handler)
        handler.event("on_train_end")
        losses = [step["loss"] for step in self.run_history if "loss" in step]
        last = self.state.log_history[-1] if self.state.log_history else {}
        return TrainOutput(loop.step_count, sum(losses) / len(losses) if losses else 0.0, last)

    def _logged_so_far(self, loop: Loop) -> list[dict[str, Any]]:
        """The metrics a resumed run logged up to its checkpoint (rank 0 reads them)."""
        metrics = Path(self._run_config.training.output_dir) / METRICS_FILE
        if loop.step_count == 0 or not loop.distributed.is_main or not metrics.is_file():
            return []
        return read_metrics(metrics)[0]

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate the policy (the initial one before `train`, the trained one after) on the
        eval_dataset given to the trainer, or on `eval_dataset`: each reward's mean, the combined
        reward, pass@k, avg@n and lengths, named `{metric_key_prefix}_...`, into log_history and
        to on_log and on_evaluate."""
        loop = self._loop if self._loop is not None else self.build()
        if loop.evaluator is None:
            raise ValueError(
                "evaluate: this trainer has no eval_dataset; pass eval_dataset to GRPOTrainer(...) "
                "(evaluate(eval_dataset=...) may then name another)"
            )
        items = None
        if eval_dataset is not None:
            path = dataset_file(eval_dataset, self.args.output_dir, "evaluate_dataset")
            items = eval_prompts(self._run_config, loop.tokenizer, [path])
        with self._script_code():
            metrics = loop.evaluate(items)
        if self._ran:  # the finished run closed its rewards; evaluating opened them again
            loop.evaluator.rewards.close()
        return self.callback_handler.evaluated(metrics, metric_key_prefix)

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
