"""The decoder forward of the Llama family, read straight from a transformers module.

`FamilyModel` keeps references to the policy's own modules and reads `module.weight` at every
forward: no copy, the same storage the optimizer updates in place. A LoRA policy's adapters are
applied in the same forward (`adapters`). Llama, Mistral, Qwen2 and Qwen3
share one layout (pre-norm, rotary GQA attention with optional q/k/v bias and optional per-head
q/k norm, SwiGLU MLP), so one forward serves them all; Qwen3-MoE is Qwen3 with a router and
experts in place of some layers' MLPs (`moe`); Gemma 3 adds its own norms and two rotary tables
to the same parts (`gemma`). Anything else returns None from `from_hf` (`refusal` says why) and
goes to the generic path (`families` picks the forward of a model type).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from grpoflow.kernels.ops import TorchOps, grouped_mm_runs
from grpoflow.models.adapters import (
    Projection,
    Term,
    adapter_state,
    add_low_rank,
    alias_down,
    attach_copies,
    fused_down,
    is_lora_layer,
    loaded_term,
    projection_of,
    refresh_copies,
    supported,
)
from grpoflow.models.fusion import Fused, alias_rows, copy_missing, drop_copies, qkv_parts, rows_view
from grpoflow.models.moe import is_sparse, routing_dtype, sparse_mlps, sparse_refusal
from grpoflow.models.moe_adapters import base_experts

LLAMA_LAYOUT_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# attend(layer_index, q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, D), qk_norm) -> (T, Hq, D): rotary,
# the cache write and the attention itself, which differ between prefill and decode.
QKNorm = tuple[torch.Tensor, torch.Tensor, float]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, QKNorm | None], torch.Tensor]


@dataclass(slots=True)
class LayerAdapters:
    """A layer's LoRA adapters by projection (all empty for a model without adapters)."""

    qkv: list[Projection]
    o: Projection
    gate_up: list[Projection]
    down: Projection

    @staticmethod
    def of(layer: nn.Module, find: Callable[[nn.Module], Projection]) -> LayerAdapters:
        """A sparse layer's MLP has no projections here: its experts' adapters are its own
        (`moe.SparseMlp.adapters`)."""
        attention, mlp = layer.self_attn, layer.mlp
        sparse = is_sparse(mlp)
        return LayerAdapters(
            qkv=[find(m) for m in (attention.q_proj, attention.k_proj, attention.v_proj)],
            o=find(attention.o_proj),
            gate_up=[] if sparse else [find(mlp.gate_proj), find(mlp.up_proj)],
            down=Projection() if sparse else find(mlp.down_proj),
        )


def _projections(layer: nn.Module) -> list[nn.Module]:
    attention, mlp = layer.self_attn, layer.mlp
    dense = [] if is_sparse(mlp) else [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj] + dense


@dataclass(slots=True)
class Shape:
    """The sizes the engine needs: heads, dims, layers, vocabulary."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    """The widest MLP activation of a token: a dense MLP's, or top k experts' for a sparse one."""
    vocab_size: int
    max_position: int
    sparse_width: int = 0
    """Elements a token's sparse MLP holds at once (its k rows through the experts); 0 if dense."""
    routing_width: int = 0
    """Entries of a token's routing record: sparse layers times experts per token."""


class FamilyModel:
    """A forward over a live Llama-family transformers model, for paged-KV decoding."""

    linear = staticmethod(F.linear)  # the projections' product (x, weight, bias)
    low_rank = staticmethod(add_low_rank)  # the adapters' products added into the projections' outputs

    def __init__(self, hf_model: nn.Module) -> None:
        self.hf_model = hf_model
        self.config = config = hf_model.config
        inner = hf_model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        attention = self.layers[0].self_attn
        num_heads = config.num_attention_heads
        head_dim = attention.q_proj.out_features // num_heads
        self.sparse = sparse_mlps(self.layers, config, grouped_mm_runs(self.device, self.dtype))
        self.shape = Shape(
            num_layers=len(self.layers),
            num_heads=num_heads,
            num_kv_heads=attention.k_proj.out_features // head_dim,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            intermediate_size=max(_intermediate_size(layer.mlp, config) for layer in self.layers),
            vocab_size=self.lm_head.out_features,
            max_position=config.max_position_embeddings,
            **_sparse_widths(self.sparse, config.hidden_size),
        )
        self.scale = float(getattr(attention, "scaling", head_dim**-0.5))
        self.windows = [_window(config, index) for index in range(len(self.layers))]
        self.has_qk_norm = hasattr(attention, "q_norm")
        self.rotary: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Rotary tables (cos, sin), each (max_len, D) in the model dtype (`build_rotary_tables`)."""
        self.rotary_of = [0] * len(self.layers)
        """The rotary table of each layer."""
        self.fused = [Fused() for _ in self.layers]
        self.lora_layers = [
            module
            for part in (*self.layers, self.lm_head)
            for module in part.modules()
            if is_lora_layer(module)
        ]
        self.loaded: dict[str, Term] = {}  # adapters sent as tensors, by module name
        self.copies: dict[tuple, list[torch.Tensor]] = {}  # adapters' copies in self.dtype
        names = {id(module): name for name, module in hf_model.named_modules()}
        self.projection_names = {
            names[id(module)]: module for module in [p for layer in self.layers for p in _projections(layer)]
        }
        self.projection_names[names[id(self.lm_head)]] = self.lm_head
        self.refresh_adapters()

    @staticmethod
    def from_hf(hf_model: nn.Module) -> FamilyModel | None:
        """The family forward for `hf_model`, or None when it is outside the supported layout."""
        return None if refusal(hf_model) else FamilyModel(hf_model)

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """(sparse layers, experts per token) of a mixture-of-experts model; None for a dense one."""
        if not self.sparse:
            return None
        return len(self.sparse), next(iter(self.sparse.values())).top_k

    @property
    def routing_dtype(self) -> torch.dtype:
        """The integer type that records this model's expert indices (`routing`)."""
        return routing_dtype(next(iter(self.sparse.values())).router.weight.shape[0])

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step may be captured in a CUDA graph: every sparse MLP runs grouped
        products (the reference loop reads the chosen experts on the host)."""
        return all(mlp.grouped for mlp in self.sparse.values())

    def adapter_signature(self) -> tuple:
        """Which adapters apply (see `adapters.adapter_state`) and where loaded ones lie;
        `refresh_fused` reads them again."""
        loaded = tuple((name, term.down.weight.data_ptr()) for name, term in self.loaded.items())
        return tuple(adapter_state(module) for module in self.lora_layers) + loaded

    def load_adapters(
        self,
        adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
        *,
        max_rank: int,
        written: Collection[torch.Tensor] = (),
    ) -> None:
        """Add adapters given as tensors (module name -> (A, B scaled); see
        `grpoflow.transport.adapters`) to plain linear layers; each replaces that layer's previous
        adapter. A layer whose base weight is among `written` (the parameters the same update
        wrote) and that gets no adapter in it loses its loaded one: its weights arrived merged, and
        it runs as a plain layer again. The others keep theirs. Every adapter is checked (a
        projection's name, shapes that fit it, rank at most `max_rank`) before any is loaded."""
        for name, (down, up) in adapters.items():
            self._check_adapter(name, down, up, max_rank)
        rewritten = {id(tensor) for tensor in written}
        dropped = [
            name
            for name in self.loaded
            if name not in adapters and id(self.projection_names[name].weight) in rewritten
        ]
        if not adapters and not dropped:
            return
        for name in dropped:
            del self.loaded[name]
        for name, (down, up) in adapters.items():
            module = self.projection_names[name]
            self.loaded[name] = loaded_term(down, up, module.weight, self.loaded.get(name))
        self.refresh_fused()

    def _check_adapter(self, name: str, down: torch.Tensor, up: torch.Tensor, max_rank: int) -> None:
        module = self.projection_names.get(name)
        if module is None or is_lora_layer(module):
            raise ValueError(
                f"no adapter can be loaded for {name!r}: name a projection of a decoder layer or the "
                f"output head, e.g. {next(iter(self.projection_names))!r}"
            )
        if (
            down.dim() != 2
            or up.dim() != 2
            or down.shape[1] != module.in_features
            or up.shape[0] != module.out_features
            or down.shape[0] != up.shape[1]
        ):
            raise ValueError(
                f"the adapter of {name} does not fit its ({module.out_features}, "
                f"{module.in_features}) weight: A {tuple(down.shape)}, B {tuple(up.shape)}; A must be "
                f"(rank, {module.in_features}) and B ({module.out_features}, rank)"
            )
        if down.shape[0] > max_rank:
            raise ValueError(
                f"the adapter of {name} has rank {down.shape[0]}, above max_lora_rank {max_rank}: raise "
                f"max_lora_rank (grpoflow serve's --max-lora-rank) or train a smaller lora_rank"
            )

    def refresh_adapters(self) -> None:
        """Find every projection's adapters again."""
        modules = {id(module): name for name, module in self.projection_names.items()}

        def find(module: nn.Module) -> Projection:
            return projection_of(module, self.loaded.get(modules[id(module)]))

        self.adapters = [LayerAdapters.of(layer, find) for layer in self.layers]
        self.head_adapters = find(self.lm_head)
        # Projections multiplied together (fused q/k/v, gate/up) or alone, the output head last.
        self.adapter_groups = [g for a in self.adapters for g in (a.qkv, [a.o], a.gate_up, [a.down])]
        self.adapter_groups.append([self.head_adapters])
        self.copies = attach_copies(self.adapter_groups, self.dtype, self.copies)
        for mlp in self.sparse.values():
            mlp.find_adapters()

    def refresh_adapter_copies(self) -> None:
        """Write the adapters' current values into their copies in the base's dtype (see
        `adapters.attach_copies`); before a rollout, when the weights' values have changed."""
        refresh_copies([term for group in self.adapter_groups for p in group for term in p.terms])
        for mlp in self.sparse.values():
            mlp.adapters.refresh()

    def fuse_projections(self) -> None:
        """Lay each layer's q/k/v weights (and biases) and gate/up weights back to back in memory
        (see `fusion`), then find the fused views."""
        for layer in self.layers:
            qkv = qkv_parts(layer.self_attn)
            if qkv is not None:
                weights, biases = qkv
                if biases is None or alias_rows(biases):
                    alias_rows(weights)
            if not is_sparse(layer.mlp):
                alias_rows([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
        for adapters in self.adapters:
            alias_down(adapters.qkv)
            alias_down(adapters.gate_up)
        self.refresh_fused()

    def refresh_fused(self) -> None:
        """Find each layer's fused views and adapters again (after parameters may have moved, or
        adapters been merged, switched or loaded)."""
        self.refresh_adapters()
        for index, layer in enumerate(self.layers):
            adapters = self.adapters[index]
            mlp = layer.mlp
            fused = Fused(
                gate_up_weight=None
                if is_sparse(mlp)
                else rows_view([mlp.gate_proj.weight, mlp.up_proj.weight]),
                qkv_down=fused_down(adapters.qkv),
                gate_up_down=fused_down(adapters.gate_up),
            )
            qkv = qkv_parts(layer.self_attn)
            if qkv is not None:
                weights, biases = qkv
                fused.qkv_bias = rows_view(biases) if biases is not None else None
                if biases is None or fused.qkv_bias is not None:
                    fused.qkv_weight = rows_view(weights)
            self.fused[index] = fused

    def copy_fused(self) -> bool:
        """Fused copies, for one engine call, of the projections whose parameters do not lie back
        to back (`fusion.copy_missing`); whether it made any. `drop_fused_copies` ends the call."""
        copied = False
        for layer, fused in zip(self.layers, self.fused):
            mlp = layer.mlp
            gate_up = None if is_sparse(mlp) else [mlp.gate_proj.weight, mlp.up_proj.weight]
            copied |= copy_missing(fused, qkv_parts(layer.self_attn), gate_up)
        return copied

    def drop_fused_copies(self) -> None:
        for fused in self.fused:
            drop_copies(fused)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def build_rotary_tables(self, max_len: int) -> None:
        """The one rotary table every layer reads."""
        rotary = self.hf_model.model.rotary_emb
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.rotary = [rotary_table(rotary.inv_freq, scaling, max_len, self.device, self.dtype)]

    def forward(
        self,
        input_ids: torch.Tensor,
        attend: Attend,
        ops: type[TorchOps],
        last_index: torch.Tensor | None = None,
        logits_out: torch.Tensor | None = None,
        routing: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of the tokens `input_ids` (T,); `attend` places them (rotary positions, KV cache).

        `last_index` (R,) picks the rows whose logits are returned; None returns all T.
        Returns (R or T, V) in the model dtype, written into `logits_out` when given (no extra copy).
        `routing` (sparse layers, T, k), when given, receives the experts each sparse layer chose.
        """
        shape = self.shape
        num_tokens = input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed.weight)
        residual, products = None, (self.linear, self.low_rank)
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            normed, residual = ops.rms_norm(
                hidden, layer.input_layernorm.weight, eps_of(layer.input_layernorm), residual
            )
            fused, adapters = self.fused[index], self.adapters[index]
            q, k, v = self.qkv(normed, attention, fused, adapters)
            qk_norm = None
            if self.has_qk_norm:
                qk_norm = (attention.q_norm.weight, attention.k_norm.weight, eps_of(attention.q_norm))
            out = attend(index, q, k, v, qk_norm).reshape(num_tokens, shape.num_heads * shape.head_dim)
            hidden = self.linear(out, attention.o_proj.weight, attention.o_proj.bias)
            self.low_rank([hidden], out, [adapters.o])
            normed, residual = ops.rms_norm(
                hidden,
                layer.post_attention_layernorm.weight,
                eps_of(layer.post_attention_layernorm),
                residual,
            )
            if index in self.sparse:
                hidden = self.sparse[index](normed, ops.silu_mul, routing)
            else:
                hidden = dense_mlp(normed, layer.mlp, fused, adapters, ops.silu_mul, *products)
        normed, _ = ops.rms_norm(hidden, self.norm.weight, eps_of(self.norm), residual)
        return self.logits(normed, last_index, logits_out)

    def logits(
        self, normed: torch.Tensor, last_index: torch.Tensor | None, logits_out: torch.Tensor | None
    ) -> torch.Tensor:
        """The output head over the final norm's rows (those of `last_index` when given)."""
        if last_index is not None:
            normed = normed[last_index]
        weight, bias = self.lm_head.weight, self.lm_head.bias
        if logits_out is None:
            logits = F.linear(normed, weight, bias)
        elif bias is None:
            logits = torch.mm(normed, weight.t(), out=logits_out)
        else:
            logits = torch.addmm(bias, normed, weight.t(), out=logits_out)
        add_low_rank([logits], normed, [self.head_adapters])
        return logits

    def qkv(
        self, normed: torch.Tensor, attention: nn.Module, fused: Fused, adapters: LayerAdapters
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, Hq, D), k and v (T, Hkv, D): views of one product when the weights are fused."""
        shape, num_tokens = self.shape, normed.shape[0]
        sizes = [shape.num_heads * shape.head_dim] + [shape.num_kv_heads * shape.head_dim] * 2
        if fused.qkv_weight is not None:
            q, k, v = self.linear(normed, fused.qkv_weight, fused.qkv_bias).split(sizes, -1)
        else:
            q, k, v = (
                self.linear(normed, m.weight, m.bias)
                for m in (attention.q_proj, attention.k_proj, attention.v_proj)
            )
        self.low_rank([q, k, v], normed, adapters.qkv, fused.qkv_down)
        return (
            q.view(num_tokens, shape.num_heads, shape.head_dim),
            k.view(num_tokens, shape.num_kv_heads, shape.head_dim),
            v.view(num_tokens, shape.num_kv_heads, shape.head_dim),
        )


def dense_mlp(
    normed: torch.Tensor,
    mlp: nn.Module,
    fused: Fused,
    adapters: LayerAdapters,
    activate_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    linear: Callable = F.linear,
    low_rank: Callable = add_low_rank,
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) (SwiGLU with `ops.silu_mul`; `linear` multiplies, `low_rank` adds
    the adapters' products), gate and up as one product when their weights are fused."""
    if fused.gate_up_weight is not None:
        gate, up = linear(normed, fused.gate_up_weight).chunk(2, dim=-1)
    else:
        gate, up = (linear(normed, m.weight, m.bias) for m in (mlp.gate_proj, mlp.up_proj))
    low_rank([gate, up], normed, adapters.gate_up, fused.gate_up_down)
    activated = activate_mul(gate, up)
    hidden = linear(activated, mlp.down_proj.weight, mlp.down_proj.bias)
    low_rank([hidden], activated, [adapters.down])
    return hidden


def rotary_table(
    inv_freq: torch.Tensor, scaling: float, max_len: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_len, D) on `device` in `dtype`, computed as transformers computes them."""
    inv_freq = inv_freq.to(device=device, dtype=torch.float32)
    positions = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def _sparse_widths(sparse: dict, hidden: int) -> dict[str, int]:
    """`Shape`'s sparse_width and routing_width: the grouped products' rows of a token (its input,
    gate/up products, activation, output, weighted output) and its routing record's entries."""
    if not sparse:
        return {}
    mlp = next(iter(sparse.values()))
    inter = mlp.experts.down_proj.shape[-1]
    return {"sparse_width": mlp.top_k * (4 * hidden + 3 * inter), "routing_width": len(sparse) * mlp.top_k}


def _intermediate_size(mlp: nn.Module, config) -> int:
    if is_sparse(mlp):
        return config.num_experts_per_tok * base_experts(mlp.experts).down_proj.shape[-1]
    return mlp.gate_proj.out_features


def refusal(hf_model: nn.Module) -> str | None:
    """Why the family forward cannot run `hf_model`; None when it can."""
    config = getattr(hf_model, "config", None)
    if getattr(config, "model_type", None) not in LLAMA_LAYOUT_TYPES:
        return "not a model type of the family path"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
        return f"rope_type {rope.get('rope_type')!r} (the family path has {', '.join(SUPPORTED_ROPE_TYPES)})"
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {config.hidden_act!r} (the family path has silu)"
    inner = getattr(hf_model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, name) for name in needed) or not hasattr(hf_model, "lm_head"):
        return (
            "a module layout other than transformers' (model.embed_tokens, layers, norm, rotary_emb; lm_head)"
        )
    for layer in inner.layers:
        reason = sparse_refusal(layer.mlp, config) if is_sparse(layer.mlp) else None
        if reason is not None:
            return reason
    if is_lora_layer(inner.embed_tokens) or not all(supported(m) for m in hf_model.modules()):
        return "LoRA adapters the family forward does not apply (a variant, a bias, embeddings)"
    return None


def eps_of(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _window(config, layer_index: int) -> int:
    """Sliding window of a layer in tokens, 0 for full attention (transformers' conventions)."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_index] == "sliding_attention" else 0
    if getattr(config, "use_sliding_window", True) is False:
        return 0
    return window
