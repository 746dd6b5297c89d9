"""The rollout-engine interface every generation backend implements.

An engine turns prompts (token ids) into sampled completions (token ids plus the log-prob of each
sampled token under the sampling distribution). The trainer talks to it through four methods and
never reaches into its internals:

    generate(prompts, params) -> list[list[Completion]]   # one list of `params.n` per prompt
    update_weights(weights, version)                       # iterable of (hf_name, tensor)
    sleep(level) / wake_up()                               # free / retake generation memory

Engines that generate straight from the policy module's parameters (the transformers reference
engine and the native engine) report `shares_policy_weights = True`; for them `update_weights`
only records the policy version.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from grpoflow.run.config import VLLMConfig


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample completions; names follow vLLM's SamplingParams."""

    n: int = 1
    """Completions per prompt (GRPO's num_generations)."""
    max_tokens: int = 256
    """Most new tokens per completion."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top probability."""
    repetition_penalty: float = 1.0
    """Penalty (> 0) on tokens already in the prompt or completion; 1.0 is off."""
    stop_token_ids: Sequence[int] = ()
    """Token ids that end a completion (the tokenizer's EOS is added by the engine's owner)."""
    stop: Sequence[str] = ()
    """Strings that end a completion once they appear in its decoded text."""
    ignore_eos: bool = False
    """Keep generating past stop tokens (benchmarks)."""
    seed: int | None = None
    """Seed for this request's sampling; None draws from the engine's generator."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")


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

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass(slots=True)
class EngineStats:
    """What the last `generate` call did, for logging."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    """The contract between the trainer and a generation backend."""

    shares_policy_weights: bool
    policy_version: int

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


@dataclass(kw_only=True, slots=True)
class EngineOptions:
    """What a factory needs to build an engine for a run (from the run's config)."""

    max_model_len: int
    """Longest prompt plus completion, in tokens."""
    gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory an engine with its own KV cache may take."""
    logprob_chunk_size: int = 4096
    """Tokens per chunk when an engine computes log-probs with a forward pass."""
    max_num_seqs: int = 512
    """Most sequences decoded at once."""
    vllm: VLLMConfig | None = None
    """The run's vLLM section, for the vLLM engines (colocated and server)."""
    exclusive_servers: bool = False
    """The rollout servers serve this training process alone (the run started them)."""
    seed: int = 0
    """The run's seed; an engine with a generator of its own derives its seed from it."""
    rank: int = 0
    """This training process's global rank (colocated engines under torchrun)."""
    world_size: int = 1
    """Training processes over all nodes."""
