"""A prediction of one GPU's peak memory during training, from the model's shape and the run's
options, before anything is loaded: pure arithmetic, in bytes.

A step has two phases that hold different memory, and the peak is the larger:
- rollout: the weights, the reference copy (unless offloaded), the optimizer state (unless
  offloaded), and the native engine's KV cache and workspace (the engine takes the cache when it
  wakes and releases it when it sleeps);
- update: the weights, the reference copy, the gradients, the optimizer state, the activations
  kept for the backward pass of one micro-batch and the float32 logits of one log-prob chunk, and
  the native engine's cache when it does not sleep (`cache_kept`, sleep_level 0).

A colocated vLLM allocates its own share of the GPU (`engine_share`, vllm_gpu_memory_utilization:
its weights, activations and KV cache) for rollouts, and holds it through the update unless it
sleeps.

Under FSDP the weights, gradients and optimizer state are sharded over the ranks (the rollout
gathers the weights in full beside each rank's shard, and so does the update without
reshard-after-forward; the native engine also copies each layer's q/k/v and gate/up weights back
to back for the rollout, `fused_copy_bytes`); LoRA trains only the adapters, whose parameters
PEFT keeps in float32, and the reference is the policy with the adapters off (no copy). The optimizer is torch's AdamW:
two moments per trained parameter, in the parameter's dtype; its foreach step (optim adamw_torch,
not the fused one) also holds a temporary the size of the trained parameters once the activations
are gone. Under FSDP reducing the gradients once per optimizer step, each rank also accumulates
the full gradients (float32 under mixed precision) in place of its shard of them: the shard is
made by the step's last reduce-scatter, layer by layer as the full ones go. Activations are an
estimate (per token and layer, a Llama-family layer keeps about 6 hidden-size, 2 key/value-size
and 4 intermediate-size vectors without gradient checkpointing, 3 when Liger's fused
activation-and-multiply recomputes the activation (measured on H200s at 7B, micro-batch 32: the
plan 5% above the peak, 14% with 4); with checkpointing, the layer's input only, plus one layer
recomputed); the allocator's fragmentation is not modelled.

A mixture-of-experts model holds (and trains, and keeps optimizer moments for) every expert of its
MoE layers, and a router per layer; a token's activations in a MoE layer are those of the
`top_k` experts it is routed to (`routed_pair_bytes`) and the router's float32 logits and
probabilities; under checkpointing every MoE layer's router logits stay until the
load-balancing loss (`algo.load_balancing`, which needs no more than them. Measured on an H200,
checkpointed, 8 layers of 128 experts, 25K tokens a micro-batch: the update's peak within 4% of
the plan's with the loss off, 10 GiB over it with the one-hot form of the loss that some
transformers versions compute). LoRA on its experts
(`target_parameters`) gives each expert of each MoE layer its own adapter. Under expert
parallelism (beside FSDP, over the same ranks) each rank holds 1/N of the experts as FSDP would,
but the update never gathers them and a rank reducing once per step accumulates the gradients of
its own experts only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpoflow.options import require

GIB = 2**30
LORA_DTYPE_BYTES = 4
"""PEFT keeps the adapters in float32 (autocast_adapter_dtype)."""
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_LINEAR = ("gate_proj", "up_proj", "down_proj")
"""The dense MLP's layers: a MoE layer has experts (fused parameters) in their place."""


@dataclass(kw_only=True, slots=True)
class ModelShape:
    """The sizes of a decoder-only transformer (a transformers config's names)."""

    hidden_size: int
    """Width of the residual stream."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int
    """Width of the MLP."""
    vocab_size: int
    """Rows of the embedding and of the output head."""
    tie_word_embeddings: bool = False
    """The output head is the embedding (one matrix)."""
    dtype_bytes: int = 2
    """Bytes per weight (2: bfloat16 or float16, 4: float32)."""
    head_dim: int | None = None
    """Width of one attention head; None: hidden_size // num_attention_heads."""
    qk_norm: bool = False
    """Each layer normalises its queries and keys per head (Qwen3): two head_dim weights."""
    num_experts: int = 0
    """Routed experts of each MoE layer (0: a dense model)."""
    num_experts_per_tok: int = 0
    """Experts a token is routed to (top_k)."""
    moe_intermediate_size: int = 0
    """Width of one expert's MLP."""
    num_moe_layers: int = 0
    """Decoder layers whose MLP is a MoE block (the others are dense)."""
    silu_experts: bool = False
    """The experts gate with SiLU (so that grpoflow_grouped runs them by default on CUDA)."""

    @classmethod
    def from_config(cls, config, dtype_bytes: int = 2) -> ModelShape:
        """From a transformers `PretrainedConfig` (no weights loaded)."""
        return cls(
            hidden_size=config.hidden_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            dtype_bytes=dtype_bytes,
            head_dim=getattr(config, "head_dim", None),
            qk_norm=config.model_type in ("qwen3", "qwen3_moe"),
            **_moe_shape(config),
        )

    @property
    def query_size(self) -> int:
        """Width of the queries of one token (all heads)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of the keys (and of the values) of one token."""
        return self.num_key_value_heads * self.attention_head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one (dense) decoder layer, by module name."""
        h, q, kv, i = self.hidden_size, self.query_size, self.kv_size, self.intermediate_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def num_parameters(self) -> int:
        """Every weight (biases ignored): embeddings, layers (a MoE layer's router and every
        expert), norms and an untied head."""
        shapes = self.linear_shapes()
        attention = sum(a * b for name, (a, b) in shapes.items() if name not in MLP_LINEAR)
        norms = 2 * self.hidden_size + (2 * self.attention_head_dim if self.qk_norm else 0)
        dense_mlp = sum(a * b for name, (a, b) in shapes.items() if name in MLP_LINEAR)
        moe_mlp = self.num_experts * (self.hidden_size + 3 * self.hidden_size * self.moe_intermediate_size)
        dense_layers = self.num_hidden_layers - self.num_moe_layers
        layers = (
            self.num_hidden_layers * (attention + norms)
            + dense_layers * dense_mlp
            + self.num_moe_layers * moe_mlp
        )
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * self.hidden_size + layers + self.hidden_size

    def expert_parameters(self) -> int:
        """The weights of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def num_active_parameters(self) -> int:
        """The weights one token multiplies by: every parameter but the experts it is not routed
        to (num_parameters for a dense model)."""
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_parameters() - self.num_moe_layers * idle * self.expert_parameters()

    def num_lora_parameters(
        self, rank: int, target_modules: list[str], target_parameters: list[str] | tuple[str, ...] = ()
    ) -> int:
        """Adapter parameters of LoRA rank `rank` on `target_modules` ("all-linear": every linear
        layer of the decoder): rank * (in + out) per adapted layer; and on the fused expert
        parameters `target_parameters` names of each MoE layer: rank * (in + out) per expert."""
        targets = ALL_LINEAR if "all-linear" in target_modules else target_modules
        shapes = self.linear_shapes()
        per_layer = {name: rank * sum(shapes[name]) for name in targets if name in shapes}
        attention = sum(size for name, size in per_layer.items() if name not in MLP_LINEAR)
        dense_layers = self.num_hidden_layers - self.num_moe_layers
        linear = self.num_hidden_layers * attention + dense_layers * (sum(per_layer.values()) - attention)
        h, i = self.hidden_size, self.moe_intermediate_size
        experts = {"gate_up_proj": h + 2 * i, "down_proj": i + h}
        per_expert = sum(
            size for name, size in experts.items() if any(t.endswith(name) for t in target_parameters)
        )
        return linear + self.num_moe_layers * self.num_experts * rank * per_expert


@dataclass(kw_only=True, slots=True)
class PlanSettings:
    """The run's options that decide its memory."""

    lora_rank: int | None = None
    """LoRA rank; None trains every parameter."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """LoRA's adapted modules."""
    target_parameters: list[str] = field(default_factory=list)
    """LoRA's adapted fused expert parameters (`experts.gate_up_proj`, `experts.down_proj`)."""
    lora_dropout: bool = False
    """LoRA's dropout is on: each adapted linear layer keeps its dropout's mask."""
    gradient_checkpointing: bool = False
    """Keep only each layer's input for the backward pass and recompute the rest."""
    micro_batch_size: int = 1
    """Sequences per forward and backward pass (per_device_train_batch_size)."""
    sequence_length: int = 1
    """Prompt plus completion tokens of a sequence."""
    prompt_length: int = 0
    """The prompt's part of sequence_length."""
    completions_per_prompt: int = 0
    """Under shared prompts, the completions that share each prompt (num_generations): a
    micro-batch runs each of its groups' prompts once; 0: every completion runs its prompt."""
    logprob_chunk_size: int = 1024
    """Tokens whose float32 logits exist at once."""
    reference_copy: bool = False
    """A separate reference model (beta > 0 with full fine-tuning)."""
    offload_model: bool = False
    """The reference copy lives on the CPU but for its log-prob pass."""
    offload_optimizer: bool = False
    """The optimizer state lives on the CPU but for the optimizer step (when it may raise the
    update's peak: the activations are gone by then)."""
    fsdp_world_size: int = 1
    """Ranks the weights, gradients and optimizer state are sharded over (1: replicated)."""
    fsdp_reshard_after_forward: bool = True
    """Under FSDP: each layer frees its gathered weights after its forward pass (false: the update
    holds the full weights from the forward to the backward pass)."""
    accumulated_gradient_bytes: int = 0
    """Under FSDP reducing once per optimizer step: bytes per trained parameter of the full
    gradients each rank accumulates over the micro-batches (0: reduced every micro-batch)."""
    expert_parallel: bool = False
    """Under FSDP: the experts split over the same ranks (`expert_model_parallel_size`), left out
    of FSDP's units."""
    optimizer_temporaries: bool = False
    """The optimizer step holds a temporary the size of the trained parameters (foreach AdamW)."""
    fused_activation: bool = False
    """The MLP's activation-and-multiply runs as one function that recomputes the activation in
    its backward pass (Liger's kernels, `use_liger_kernel`): 3 intermediate-size vectors a token
    and layer, not 4."""
    kv_cache_bytes: int = 0
    """The native engine's KV cache and workspace during rollouts (0: an engine elsewhere)."""
    cache_kept: bool = False
    """The engine keeps its memory through the update too (sleep_level 0): the native engine its
    cache, a colocated vLLM its share."""
    engine_share: float = 0.0
    """Share of the GPU an engine that allocates its own memory holds beside the trainer (a
    colocated vLLM: vllm_gpu_memory_utilization), during rollouts and, kept, the update."""
    fused_copies: bool = False
    """Under FSDP, the rollout engine multiplies by copies of each layer's q/k/v and gate/up weights
    laid back to back (the native engine: `fused_copy_bytes`)."""
    grouped_experts: bool | None = None
    """A MoE model's experts run as `experts_implementation` grpoflow_grouped (None: as unset on
    CUDA, where the experts gate with SiLU)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "sequence_length", "logprob_chunk_size", "fsdp_world_size"):
            require(getattr(self, name) >= 1, name, ">= 1", getattr(self, name))
        require(
            0 <= self.prompt_length < self.sequence_length,
            "prompt_length",
            f"in [0, sequence_length {self.sequence_length})",
            self.prompt_length,
        )
        require(
            self.completions_per_prompt >= 0, "completions_per_prompt", ">= 0", self.completions_per_prompt
        )

    @property
    def micro_batch_tokens(self) -> int:
        """Tokens one micro-batch runs: every sequence in full, or under shared prompts each
        completion and its groups' prompts once (a micro-batch not aligned to the groups holds
        parts of one more)."""
        size, group = self.micro_batch_size, self.completions_per_prompt
        if not group:
            return size * self.sequence_length
        prompts = min(size, -(-size // group) + (size % group != 0))
        return size * (self.sequence_length - self.prompt_length) + prompts * self.prompt_length


@dataclass(slots=True)
class MemoryPlan:
    """Bytes per part of one GPU's memory, by phase, and the GPU's capacity."""

    rollout: dict[str, int]
    """Parts held while the engine generates."""
    update: dict[str, int]
    """Parts held during the policy update."""
    capacity: int
    """The GPU's memory in bytes."""

    @property
    def peak(self) -> int:
        return max(sum(self.rollout.values()), sum(self.update.values()))

    @property
    def peak_phase(self) -> str:
        return "update" if sum(self.update.values()) >= sum(self.rollout.values()) else "rollout"

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def largest_parts(self, count: int = 3) -> list[tuple[str, int]]:
        """The largest parts of the peak phase, largest first."""
        parts = self.update if self.peak_phase == "update" else self.rollout
        return sorted(parts.items(), key=lambda item: -item[1])[:count]


def resident_parts(shape: ModelShape, settings: PlanSettings) -> dict[str, int]:
    """What stays on the GPU through a step: weights, reference copy, optimizer state."""
    shards = settings.fsdp_world_size
    weights = shape.num_parameters() * shape.dtype_bytes
    if settings.lora_rank is not None:
        trained_bytes = _trained_parameters(shape, settings) * LORA_DTYPE_BYTES
    else:
        trained_bytes = weights
    return {
        "weights": weights // shards,
        "reference": 0 if not settings.reference_copy or settings.offload_model else weights // shards,
        "adapters": trained_bytes // shards if settings.lora_rank is not None else 0,
        "optimizer": 0 if settings.offload_optimizer else 2 * trained_bytes // shards,
    }


def _moe_shape(config) -> dict[str, int]:
    """A transformers config's MoE sizes (Qwen-MoE's names, Mixtral's num_local_experts); {} for a
    dense model. Qwen-MoE's `mlp_only_layers` and `decoder_sparse_step` leave some layers dense."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    if not experts:
        return {}
    skipped = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", None) or 1
    moe_layers = [i for i in range(config.num_hidden_layers) if i not in skipped and (i + 1) % step == 0]
    return {
        "num_experts": experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
        "num_moe_layers": len(moe_layers),
        "silu_experts": getattr(config, "hidden_act", None) in ("silu", "swish"),
    }


def routed_pair_bytes(shape: ModelShape, settings: PlanSettings) -> int:
    """Bytes a MoE layer keeps for the backward per (token, routed expert) pair: grpoflow_grouped's
    gate and up projections and two sort indices; other implementations' copy of the hidden state
    in and out and 4 intermediate-size vectors."""
    h, i, e = shape.hidden_size, shape.moe_intermediate_size, shape.dtype_bytes
    grouped = settings.grouped_experts
    if grouped or (grouped is None and shape.silu_experts):
        return 2 * i * e + 2 * 8
    return (2 * h + 4 * i) * e


def _trained_parameters(shape: ModelShape, settings: PlanSettings) -> int:
    if settings.lora_rank is None:
        return shape.num_parameters()
    return shape.num_lora_parameters(settings.lora_rank, settings.target_modules, settings.target_parameters)


def dropout_bytes(shape: ModelShape, settings: PlanSettings) -> tuple[int, int]:
    """Bytes per token that LoRA's dropout keeps in one layer's attention and in its dense MLP:
    each adapted linear layer's one-byte mask (`lora_dropout`: the product keeps the input itself,
    which the base layers' estimate counts)."""
    if settings.lora_rank is None or not settings.lora_dropout:
        return 0, 0
    targets = ALL_LINEAR if "all-linear" in settings.target_modules else settings.target_modules
    kept = {name: size for name, (size, _) in shape.linear_shapes().items()}
    attention = sum(kept[name] for name in targets if name in kept and name not in MLP_LINEAR)
    return attention, sum(kept[name] for name in targets if name in MLP_LINEAR)


def activation_bytes(shape: ModelShape, settings: PlanSettings) -> int:
    """Activations one micro-batch keeps for its backward pass (see the module's docstring)."""
    h, kv, i, e = shape.hidden_size, shape.kv_size, shape.intermediate_size, shape.dtype_bytes
    tokens = settings.micro_batch_tokens
    attention_dropout, mlp_dropout = dropout_bytes(shape, settings)
    mlp = (3 if settings.fused_activation else 4) * i * e  # gate, up, (activation,) their product
    full_layer = (6 * h + 2 * kv) * e + mlp + 2 * h * 4  # plus the norms' float32 statistics
    full_layer += attention_dropout + mlp_dropout
    routed = shape.num_experts_per_tok * routed_pair_bytes(shape, settings)
    moe_layer = full_layer - mlp - mlp_dropout + routed + 2 * shape.num_experts * 4
    dense_layers = shape.num_hidden_layers - shape.num_moe_layers
    if settings.gradient_checkpointing:
        routers = shape.num_moe_layers * shape.num_experts * 4
        return tokens * (
            shape.num_hidden_layers * h * e + routers + (moe_layer if shape.num_moe_layers else full_layer)
        )
    return tokens * (dense_layers * full_layer + shape.num_moe_layers * moe_layer)


def fused_copy_bytes(shape: ModelShape) -> int:
    """The copies the native engine multiplies by when a layer's q/k/v and gate/up weights lie in
    separate tensors (FSDP's gathered ones): one fused matrix of each per layer (q/k/v alone in a
    MoE layer), for the length of a rollout (`models.fusion.copy_missing`)."""
    shapes = shape.linear_shapes()
    qkv = sum(a * b for name, (a, b) in shapes.items() if name in ("q_proj", "k_proj", "v_proj"))
    gate_up = sum(a * b for name, (a, b) in shapes.items() if name in ("gate_proj", "up_proj"))
    dense = shape.num_hidden_layers - shape.num_moe_layers
    return (shape.num_hidden_layers * qkv + dense * gate_up) * shape.dtype_bytes


def plan_memory(shape: ModelShape, settings: PlanSettings, capacity: int) -> MemoryPlan:
    """The plan of one GPU of `capacity` bytes (see the module's docstring)."""
    resident = resident_parts(shape, settings)
    gathered = shape.num_parameters() * shape.dtype_bytes if settings.fsdp_world_size > 1 else 0
    copies = fused_copy_bytes(shape) if gathered and settings.fused_copies else 0
    engine = int(settings.engine_share * capacity)
    rollout = {
        **resident,
        "gathered_weights": gathered,
        "fused_copies": copies,
        "kv_cache": settings.kv_cache_bytes,
        "vllm": engine,
    }
    trained = resident["adapters"] if settings.lora_rank is not None else resident["weights"]
    reference = resident["reference"]
    if settings.reference_copy and settings.offload_model:  # on the GPU for its own pass only
        reference = shape.num_parameters() * shape.dtype_bytes // settings.fsdp_world_size
    chunk = min(settings.logprob_chunk_size, settings.micro_batch_size * settings.sequence_length)
    activations = activation_bytes(shape, settings)
    logits = 3 * chunk * shape.vocab_size * 4  # float32 logits, their exp and their gradient
    # The optimizer step runs after the backward pass has freed activations and logits: only what
    # it brings beyond them raises the phase's peak (its temporaries; offloaded moments, which
    # come back to the GPU for it).
    step = trained if settings.optimizer_temporaries else 0
    if settings.offload_optimizer:
        step += 2 * trained
    shards, experts = settings.fsdp_world_size, 0
    if settings.expert_parallel and shards > 1:
        experts = shape.num_moe_layers * shape.num_experts * shape.expert_parameters()
    accumulated = _trained_parameters(shape, settings)
    if settings.lora_rank is None:  # only a rank's own experts' gradients
        accumulated -= experts - experts // shards
    accumulated *= settings.accumulated_gradient_bytes
    update = {
        **resident,
        "reference": reference,
        "gradients": 0 if accumulated else trained,
        "activations": activations,
        "logits": logits,
        "gathered_weights": 0
        if settings.fsdp_reshard_after_forward
        else gathered - experts * shape.dtype_bytes,
        "accumulated_gradients": accumulated,
        "optimizer_step": max(0, step - activations - logits),
        "kv_cache": settings.kv_cache_bytes if settings.cache_kept else 0,
        "vllm": engine if settings.cache_kept else 0,
    }
    return MemoryPlan(
        rollout={k: v for k, v in rollout.items() if v},
        update={k: v for k, v in update.items() if v},
        capacity=capacity,
    )
