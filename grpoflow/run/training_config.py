"""The training section of a run's config: optimiser, schedule, micro-batches, checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from grpoflow.distributed import DistributedContext
from grpoflow.options import require
from grpoflow.policy.auto_settings import DEFAULT_MICRO_BATCH
from grpoflow.policy.placement import Placement
from grpoflow.policy.tiny import DEFAULT_SEED
from grpoflow.run.checkpoint import Checkpointer


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """Optimisation, schedule, checkpoints."""

    optim: Literal["adamw_torch_fused", "adamw_torch"] = "adamw_torch_fused"
    """The optimizer, by transformers' names: torch's AdamW with its fused kernel (a few kernels
    per step and no full-size temporaries), or with its multi-tensor (foreach) kernels, whose
    step holds a temporary the size of the trained parameters."""
    learning_rate: float = 1e-6
    """Peak learning rate of AdamW."""
    lr_scheduler_type: Literal[
        "linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial"
    ] = "linear"
    """Learning-rate schedule (transformers' names)."""
    warmup_ratio: float = 0.0
    """Fraction of steps spent warming up."""
    warmup_steps: int = 0
    """Optimizer steps spent warming up (num_iterations per training step), instead of
    warmup_ratio; 0: warmup_ratio decides."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm; 0 turns clipping off."""
    per_device_train_batch_size: int | None = None
    """Completions per micro-batch; unset: 8 for the generation batch (per_device_train_batch_size
    x gradient_accumulation_steps), which `grpoflow train` on a GPU cuts into micro-batches as
    large as the memory plan allows (a multiple of 8 that divides it)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; a step generates their completions in one batch."""
    padding_free: bool = False
    """Run each micro-batch's forward passes (policy, old policy, reference) on its sequences
    packed end to end in one row, attention kept within each, so an update costs the real tokens
    rather than the padded rectangle; the losses are unchanged."""
    shared_prompts: bool | None = None
    """Run each group's prompt through the update's forward passes once, its completions packed
    after it, each attending to the prompt and to itself (`algo.shared_prompts`): an update costs
    the prompt once per group rather than once per completion, and no padding. None: on where it
    runs (`grpoflow train` on CUDA with torch's varlen attention, attn_implementation unset or
    grpoflow_varlen, neither the batch-invariant kernels nor a mixture-of-experts model), the
    reason recorded in run.json."""
    max_tokens_per_micro_batch: int | None = None
    """Under padding_free, form micro-batches of consecutive completions whose prompt and
    completion tokens fit this budget (a longer sequence gets a micro-batch of its own) instead of
    per_device_train_batch_size completions each; None keeps per_device_train_batch_size."""
    group_by_length: bool | None = None
    """Form micro-batches of completions of similar lengths (longest first), so a padded
    micro-batch is little more than its real tokens. The update is unchanged for every loss but
    bnpo, which normalises by each micro-batch's tokens, and top_entropy_quantile < 1, taken per
    micro-batch; None: on, except for those two."""
    num_train_epochs: float = 1.0
    """Passes over the prompts when max_steps is not set."""
    max_steps: int = -1
    """Training steps (each: one generation batch, num_iterations optimizer steps); -1 uses
    num_train_epochs."""
    seed: int = DEFAULT_SEED
    """Seed of data order, sampling and initialisation."""
    output_dir: str = "outputs/grpoflow"
    """Where checkpoints, metrics and logs go; one run per directory."""
    overwrite_output_dir: bool = False
    """Let a new run take an output_dir holding another run's files, deleting them when training
    starts (checkpoints, run.json, metrics and completions logs, TensorBoard's runs/; nothing else);
    also lets a resume from an older checkpoint delete the run's later ones."""
    save_strategy: Literal["steps", "no"] = "steps"
    """`steps`: save a checkpoint every save_steps steps and at the end; `no`: none on that
    schedule (a run that stops early, on a failure or an interrupt, still saves one to resume
    from, and metric_for_best_model still keeps checkpoint-best)."""
    save_steps: int = 500
    """Under save_strategy steps, save a checkpoint every this many steps (and at the end)."""
    save_total_limit: int | None = None
    """Keep at most this many checkpoints (oldest deleted)."""
    resume_from_checkpoint: str | None = None
    """A checkpoint directory, or `latest` for the newest of the run in output_dir."""

    def __post_init__(self) -> None:
        positive = (
            "learning_rate",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "num_train_epochs",
            "save_steps",
            "save_total_limit",
            "max_tokens_per_micro_batch",
        )
        for name in positive:
            value = getattr(self, name)
            require(value is None or value > 0, name, "> 0", value)
        require(
            self.max_tokens_per_micro_batch is None or self.padding_free,
            "max_tokens_per_micro_batch",
            "None unless padding_free is on",
            self.max_tokens_per_micro_batch,
            "set padding_free: true to form micro-batches by a token budget",
        )
        require(0 <= self.warmup_ratio < 1, "warmup_ratio", "in [0, 1)", self.warmup_ratio)
        require(self.warmup_steps >= 0, "warmup_steps", ">= 0", self.warmup_steps)
        require(
            not (self.warmup_steps and self.warmup_ratio),
            "warmup_steps",
            "0 when warmup_ratio is set",
            self.warmup_steps,
            "set the warmup once: in steps (warmup_steps) or as a fraction of the run (warmup_ratio)",
        )
        require(
            self.max_steps > 0 or self.max_steps == -1,
            "max_steps",
            "> 0, or -1 to use num_train_epochs",
            self.max_steps,
        )

    @property
    def micro_batch_size(self) -> int:
        """per_device_train_batch_size, or its default when unset."""
        return self.per_device_train_batch_size or DEFAULT_MICRO_BATCH

    def warmup(self, optimizer_steps: int) -> int:
        """Optimizer steps of warmup in a run of `optimizer_steps`."""
        return self.warmup_steps or math.ceil(self.warmup_ratio * optimizer_steps)

    def saves_at(self, step: int, total_steps: int) -> bool:
        """Whether step `step` of `total_steps` ends with a scheduled checkpoint."""
        if self.save_strategy == "no":
            return False
        return step % self.save_steps == 0 or step == total_steps

    def checkpointer(
        self, placement: Placement, tokenizer, distributed: DistributedContext, run_id: str | None
    ) -> Checkpointer:
        """The run's checkpoints: in output_dir, on the save schedule, at most save_total_limit."""
        return Checkpointer(
            output_dir=self.output_dir,
            placement=placement,
            tokenizer=tokenizer,
            distributed=distributed,
            is_due=self.saves_at,
            save_total_limit=self.save_total_limit,
            run_id=run_id,
        )
