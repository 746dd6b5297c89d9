"""`PlacementConfig`: how a run lays its policy out over devices, ranks and the CPU (applied by
`grpoflow.policy.placement.place_models`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from grpoflow.options import require, require_min

MixedPrecision = Literal["auto", "bf16", "no"]


@dataclass(kw_only=True, slots=True)
class PlacementConfig:
    """How a run lays its policy (and reference model) out over devices, ranks and the CPU."""

    fsdp: bool = False
    """Over several processes, shard parameters, gradients and optimizer state with PyTorch FSDP2
    (one unit per decoder layer); off, every rank holds a full copy and gradients are summed over
    ranks (as DDP)."""
    fsdp_offload_params: bool = False
    """Under fsdp: keep the sharded parameters, gradients and optimizer state on the CPU (the
    optimizer steps there); each unit comes to the GPU for its forward and backward."""
    fsdp_reshard_after_forward: bool | None = None
    """Under fsdp: free each decoder layer's gathered weights after its forward pass and gather
    them again for the backward pass (least memory); false: keep them from the rollout's gather (or
    the first forward pass) to the optimizer step's last backward pass, no all-gather in the
    update rather than two per micro-batch, for the full weights' memory during the update
    (FSDP2's reshard_after_forward, accelerate's fsdp_reshard_after_forward). Unset: false where
    the memory plan fits it (`run.plan_check.choose_fsdp_layout`), else true."""
    fsdp_reduce_every_micro_batch: bool | None = None
    """Under fsdp: reduce-scatter the gradients after every micro-batch's backward pass (each rank
    holds only its shard of them); false: once per optimizer step, after its last micro-batch,
    each rank accumulating the full gradients until then (in float32 under mixed precision: 4
    bytes per trained parameter more memory, a micro-batch count fewer reductions). Unset: as
    fsdp_reshard_after_forward."""
    fsdp_mixed_precision: MixedPrecision = "auto"
    """Under fsdp: bf16 gathers float32 weights in bfloat16 for forward and backward and reduces
    gradients in float32 (sharded weights and optimizer state keep their dtype); auto is bf16 on
    a GPU, no on the CPU; no computes and reduces in the weights' dtype."""
    offload_model: bool = False
    """Keep the policy's weights on the CPU while an engine with its own copy (vLLM) generates,
    and a reference model copy on the CPU except for its log-prob pass (replicated training)."""
    offload_optimizer: bool = False
    """Keep the optimizer state on the CPU between optimizer steps (replicated training)."""
    gc_collect_after_offload: bool = False
    """Collect garbage and empty the CUDA cache after each offload."""
    expert_model_parallel_size: int = 1
    """Under fsdp, a mixture-of-experts policy's experts split over this many ranks (expert
    parallelism: each rank keeps 1/N of every MoE layer's experts, and tokens travel to them by
    all-to-all exchanges); the other parameters stay under FSDP. 1 (off) or the number of
    processes; needs the native rollout engine (ms-swift/Megatron's expert_model_parallel_size)."""

    def __post_init__(self) -> None:
        choices = get_args(MixedPrecision)
        require(
            self.fsdp_mixed_precision in choices,
            "fsdp_mixed_precision",
            f"one of {', '.join(choices)}",
            self.fsdp_mixed_precision,
        )
        require(
            self.fsdp or not self.fsdp_offload_params,
            "fsdp_offload_params",
            "false without fsdp",
            True,
            "fsdp_offload_params needs fsdp=true (it offloads FSDP's shards)",
        )
        require_min("expert_model_parallel_size", self.expert_model_parallel_size, 1, " (1: off)")
        require(
            self.expert_model_parallel_size == 1 or self.fsdp,
            "expert_model_parallel_size",
            "1 without fsdp",
            self.expert_model_parallel_size,
            "expert parallelism runs beside FSDP: set fsdp: true, or expert_model_parallel_size: 1",
        )
        for name in ("offload_model", "offload_optimizer"):
            require(
                not (self.fsdp and getattr(self, name)),
                name,
                "false under fsdp",
                True,
                f"{name} moves a replicated model's memory and does not apply under fsdp: use "
                "fsdp_offload_params=true (sharded parameters, gradients and optimizer state on the CPU), "
                "or fsdp=false",
            )

    @property
    def reshards_after_forward(self) -> bool:
        """fsdp_reshard_after_forward as the run applies it: unset reads as true, the layout of
        least memory (`run.plan_check.choose_fsdp_layout` sets it before a run is built)."""
        return self.fsdp_reshard_after_forward is not False

    @property
    def reduces_every_micro_batch(self) -> bool:
        """fsdp_reduce_every_micro_batch as the run applies it: unset reads as true."""
        return self.fsdp_reduce_every_micro_batch is not False
