"""The rollout-engine interface every generation backend implements.

An engine turns prompts (token ids) into sampled completions (token ids plus the log-prob of each
sampled token under the sampling distribution). The trainer talks to it through four methods and
never reaches into its internals:

    generate(prompts, params) -> list[list[Completion]]   # one list of `params.n` per prompt
    update_weights(weights, version)                       # iterable of (hf_name, tensor)
    sleep(level) / wake_up()                               # free / retake generation memory

What an engine offers beyond these (LoRA adapters sent as tensors or applied unmerged, a prefix
cache, one SamplingParams per prompt, aborts, hosting, rollout servers) it states once, when built,
in its `capabilities` (`EngineCapabilities`); the run, the server and the rollouts read that record
and never probe an engine for attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from grpoflow.algo.truncation import Truncation
from grpoflow.options import NOT_AN_OPTION, key, require, require_fraction, require_min


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample completions; names follow vLLM's SamplingParams. The one definition of the
    sampling fields: the run's config, every engine and the native sampler read these."""

    n: int = field(default=1, metadata=NOT_AN_OPTION)
    """Completions per prompt (the run sets GRPO's num_generations)."""
    max_tokens: int = field(default=512, metadata=key("max_completion_length"))
    """Most new tokens per completion."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy. Log-probs are taken on logits divided by it."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top probability."""
    repetition_penalty: float = 1.0
    """Penalty (> 0) on tokens already in the prompt or completion; 1.0 is off."""
    stop_token_ids: Sequence[int] = field(default=(), metadata=NOT_AN_OPTION)
    """Token ids that end a completion (the tokenizer's EOS is added by the engine's owner)."""
    stop: Sequence[str] = ()
    """Extra strings that end a completion once they appear in its decoded text."""
    ignore_eos: bool = field(default=False, metadata=NOT_AN_OPTION)
    """Keep generating past stop tokens (benchmarks)."""
    seed: int | None = field(default=None, metadata=NOT_AN_OPTION)
    """Seed for this request's sampling; None draws from the engine's generator."""
    sample_offset: int = field(default=0, metadata=NOT_AN_OPTION)
    """Index of the first of the `n` samples in a seeded request's streams (native engine: to
    continue sample j of an earlier request with the same seed)."""
    draw: Literal["inversion", "gumbel"] = field(default="inversion", metadata=NOT_AN_OPTION)
    """Native engine: how a token is drawn from its key (`grpoflow.algo.draws`)."""
    token_offset: int = field(default=0, metadata=NOT_AN_OPTION)
    """Index in each sample's stream of the first token to draw (native engine: to continue a
    completion whose first `token_offset` tokens end the prompt)."""

    def __post_init__(self) -> None:
        require_min("n", self.n, 1)
        require_min("max_tokens (max_completion_length)", self.max_tokens, 1)
        require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        require(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        require(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        require(self.repetition_penalty > 0, "repetition_penalty", "> 0", self.repetition_penalty)
        require(self.sample_offset >= 0, "sample_offset", ">= 0", self.sample_offset)
        require(self.token_offset >= 0, "token_offset", ">= 0", self.token_offset)

    @property
    def truncation(self) -> Truncation:
        """The top_k/top_p/min_p filters as one object (`grpoflow.algo.truncation`)."""
        return Truncation(top_k=max(self.top_k, 0), top_p=self.top_p, min_p=self.min_p)

    def distribution(self) -> dict[str, float | int]:
        """The fields that shape the distribution each token is drawn from and scored under
        (temperature, top_p, top_k, min_p, repetition_penalty), top_k -1 for all tokens: two
        requests with equal ones draw from the same distribution."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k > 0 else -1,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How big an engine with its own KV cache may grow (the native and vLLM engines); names and
    meanings follow vLLM's engine arguments. Shared by a training run and `grpoflow serve`."""

    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the process may hold once the KV cache is allocated (the
    policy's weights and the trainer's memory included when the engine runs in the trainer)."""
    max_num_seqs: int = 512
    """Most sequences decoded at once (rows of a decode step)."""
    max_model_len: int | None = None
    """Longest prompt plus completion in tokens; unset: max_prompt_length + max_completion_length
    in a training run, the model's max_position_embeddings in `grpoflow serve`."""

    def __post_init__(self) -> None:
        require_fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        require_min("max_num_seqs", self.max_num_seqs, 1)
        require_min("max_model_len", self.max_model_len, 2)


@dataclass(slots=True)
class Completion:
    """One sampled completion."""

    token_ids: list[int]
    """Generated token ids, the stop token included when one ended the completion."""
    logprobs: list[float]
    """Log-prob of each generated token under the (temperature-scaled) sampling distribution."""
    finish_reason: str
    """'stop' (a stop token or string ended it) or 'length' (max_tokens reached: truncated)."""
    policy_version: int = 0
    """Version of the weights that sampled it."""
    text: str | None = None
    """Decoded text when the engine decodes; the trainer decodes otherwise."""
    mask: list[int] | None = None
    """Per token: 1 where the policy sampled it, 0 where an environment inserted it (a tool
    result, a user turn) in a multi-turn episode; such tokens get no loss. None: all sampled."""
    distributions: dict[int, torch.Tensor] | None = None
    """Position -> the engine's whole next-token distribution there, `log_softmax(logits / T)`
    float32 `(vocab,)`, at the few sampled positions it kept (`distribution_positions`)."""
    routed_experts: torch.Tensor | None = None
    """The experts a mixture-of-experts policy chose for each position, prompt then completion:
    a CPU integer tensor (len(prompt ids) + len(token_ids), sparse layers, experts per token),
    recorded when each position's token was fed through the model; -1 where a position was never
    fed (the last sampled token). None unless the engine records routing (the native engine's
    `record_routing`)."""

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def loss_mask(self) -> list[int]:
        """`mask`, or all ones for a completion the policy sampled whole."""
        return self.mask if self.mask is not None else [1] * len(self.token_ids)


class NonFiniteLogits(RuntimeError):
    """The model's logits held NaN or infinity while sampling: its weights have diverged."""


@dataclass(slots=True)
class PrefillStats:
    """Where the keys and values of a call's prompt tokens came from (engines with a prefix cache)."""

    num_prefill_tokens: int = 0
    """Tokens run through the model in prefill steps (prompts, and sequences prefilled again
    after a preemption)."""
    num_cached_tokens: int = 0
    """Tokens whose keys and values were read from the prefix cache instead."""

    def __add__(self, other: PrefillStats) -> PrefillStats:
        return PrefillStats(
            self.num_prefill_tokens + other.num_prefill_tokens,
            self.num_cached_tokens + other.num_cached_tokens,
        )


def prefix_cache_metrics(stats: PrefillStats | None) -> dict[str, float]:
    """`rollout/prefill_tokens`, `rollout/prefix_cache_hit_tokens` and
    `rollout/prefix_cache_hit_rate` (cached over cached plus prefilled); {} without stats."""
    if stats is None:
        return {}
    total = stats.num_prefill_tokens + stats.num_cached_tokens
    return {
        "rollout/prefill_tokens": float(stats.num_prefill_tokens),
        "rollout/prefix_cache_hit_tokens": float(stats.num_cached_tokens),
        "rollout/prefix_cache_hit_rate": stats.num_cached_tokens / total if total else 0.0,
    }


@dataclass(slots=True)
class EngineStats:
    """What the last `generate` call did, for logging."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    prefill: PrefillStats | None = None
    """Prefilled and prefix-cached prompt tokens; None where the engine does not count them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineCapabilities:
    """What an engine offers beyond the protocol's methods, stated when it is built."""

    name: str
    """Its registry name (`grpoflow.engines.ENGINES`): a server hosting it reports it as --engine."""
    accepts_adapters: bool = False
    """With its own copy of the weights, it takes a LoRA policy's adapters as tensors
    (`grpoflow.transport.adapters`) and adds them to its base: once it `holds_base`, they go alone."""
    applies_adapters: bool = False
    """It generates a LoRA policy from its LoRA layers as they are: the base stays unmerged."""
    max_adapter_rank: int | None = None
    """The largest adapter rank `update_weights` takes; None: any."""
    adaptable_modules: frozenset[str] | None = None
    """The layers (last name part) an adapter may adapt; None: any, or not known."""
    per_prompt_params: bool = False
    """`generate` takes one SamplingParams per prompt, on_error="error_completion" and an `intake`
    of requests that join the running call."""
    aborts: bool = False
    """`generate` takes an `abandoned` hook naming prompts nobody waits for, and stops them."""
    distributions: bool = False
    """Its completions carry the whole next-token distribution at sampled positions when asked
    (`EngineOptions.distribution_positions`)."""
    prefix_cache: bool = False
    """It keeps prompt prefixes' keys and values across calls; `reset_prefix_cache` drops them."""
    decodes_texts: bool = False
    """Its completions' `text` is the run tokenizer's `decode(token_ids, skip_special_tokens=True)`,
    cut at a stop string the request named: a caller decoding the same way may take it as is."""
    module: torch.nn.Module | None = None
    """The module it generates from, which a server hosting it in-process exposes."""
    model_dir: Path | None = None
    """The checkpoint its own copy of the weights came from, which a hosting server reads instead."""
    servers: tuple[tuple[str, str], ...] = ()
    """(base URL, served model name) of each rollout server it generates on; empty: in-process."""


@runtime_checkable
class RolloutEngine(Protocol):
    """The contract between the trainer and a generation backend."""

    capabilities: EngineCapabilities
    shares_policy_weights: bool
    """It generates from the policy module's own parameters: `update_weights` records the version."""
    holds_base: bool
    """It holds the base weights a LoRA policy's adapters add to (after its first sync)."""
    policy_version: int
    stats: EngineStats
    """What the last `generate` call did."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample `params.n` completions for each prompt (token ids, no padding). No prompts give
        an empty list: over several ranks every rank calls `generate` in every sampling round,
        with no prompts when it lacks none, so ranks sharing an engine stay in step."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new policy weights, given as (Hugging Face parameter name, tensor) pairs."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Release generation memory (KV cache; level 2 also drops weights it owns)."""
        ...

    def wake_up(self) -> None:
        """Take generation memory back before the next `generate`."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (nothing to do without `capabilities.prefix_cache`)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (servers' connections, vLLM, temporary files)."""
        ...


@dataclass(kw_only=True, slots=True)
class EngineOptions:
    """What a registry factory gets to build an engine: the engine's own settings and the facts of
    the process it runs in."""

    engine: EngineConfig
    """Sizes of an engine with its own KV cache; `max_model_len` is set."""
    logprob_chunk_size: int = 4096
    """Tokens per chunk when an engine computes log-probs with a forward pass."""
    vllm: Any = None
    """The colocated vLLM engine's settings (`grpoflow.engines.vllm.VLLMConfig`)."""
    remote: Any = None
    """The rollout servers' settings (`grpoflow.remote.engine.RemoteConfig`)."""
    exclusive_servers: bool = False
    """The rollout servers serve this training process alone (the run started them)."""
    seed: int = 0
    """The run's seed; an engine with a generator of its own derives its seed from it."""
    rank: int = 0
    """This training process's global rank (colocated engines under torchrun)."""
    world_size: int = 1
    """Training processes over all nodes."""
    distribution_positions: int = 0
    """Sampled positions per call whose whole distribution the completions carry, where the
    engine can (`EngineCapabilities.distributions`); 0: none."""
    batch_invariant: bool = False
    """The native engine computes logits with the batch-invariant kernels (see
    `NativeEngineConfig.batch_invariant`)."""
    record_routing: bool = False
    """Completions carry the experts a mixture-of-experts policy routed each position to
    (`Completion.routed_experts`), where the engine can: the native engine's family path."""

    @property
    def max_model_len(self) -> int:
        """Longest prompt plus completion, in tokens."""
        assert self.engine.max_model_len is not None, "EngineOptions needs engine.max_model_len"
        return self.engine.max_model_len
