"""What a user's rollout function (TRL's `rollout_func`) gets to work with.

TRL calls `rollout_func(prompts, trainer)` with its whole trainer; the parts such functions use
are the tokenizer (`processing_class`), the config (`args`), the sampling settings, the step, and
`generate_rollout_completions(trainer, prompts)` to sample with the run's engine. `RolloutTrainer`
offers exactly those, under TRL's names, for one call; `generate_rollout_completions` has the call
and return shape of TRL's helper (one completion per prompt: prompt ids, completion ids, the
sampling log-prob of each completion token, the text).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from grpoflow.engines import RolloutEngine, SamplingParams

OVERRIDABLE = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_tokens",
    "stop",
    "seed",
    "n",
)
"""Sampling settings `generation_overrides` may change (vLLM's names, as TRL passes them)."""

IGNORED = frozenset({"logprobs"})
"""Overrides that mean nothing here: log-probs of the sampled tokens always come back."""


@dataclass(kw_only=True)
class RolloutTrainer:
    """The `trainer` a rollout function receives: TRL's names for what such functions read.

    `args` holds every option of the run by its flat key (`args.max_completion_length`,
    `args.num_generations`, ...); the sampling settings are also attributes, as on TRL's trainer.
    """

    processing_class: Any
    """The policy's tokenizer."""
    args: SimpleNamespace
    """The run's options by flat key."""
    engine: RolloutEngine
    """The run's rollout engine (what `generate_rollout_completions` samples with)."""
    sampling: SamplingParams
    """The run's sampling settings for one completion (n is 1)."""
    num_generations: int
    """Completions per prompt (G); the prompts a rollout function receives repeat each prompt G times."""
    per_prompt_params: bool = False
    """The engine takes one SamplingParams per prompt (each with its own seed)."""
    seed: int | None = None
    """Seed of this call's sampling; None draws from the engine's generator."""
    _seeds: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._seeds = random.Random(self.seed)

    @property
    def tokenizer(self) -> Any:
        return self.processing_class

    @property
    def max_completion_length(self) -> int:
        return self.sampling.max_tokens

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        return self.sampling.top_p

    @property
    def top_k(self) -> int:
        return self.sampling.top_k

    @property
    def min_p(self) -> float:
        return self.sampling.min_p

    @property
    def repetition_penalty(self) -> float:
        return self.sampling.repetition_penalty

    @property
    def state(self) -> SimpleNamespace:
        """`state.global_step`: the version of the weights the engine samples with."""
        return SimpleNamespace(global_step=self.engine.policy_version)

    def sampling_params(
        self, num_prompts: int, overrides: dict[str, Any] | None
    ) -> SamplingParams | list[SamplingParams]:
        """The params of one `generate` call over `num_prompts` prompts: the run's settings with
        `overrides`, and a seed per prompt drawn from this call's seed when the run seeds them."""
        given = {name: value for name, value in (overrides or {}).items() if value is not None}
        unknown = sorted(set(given) - set(OVERRIDABLE) - IGNORED)
        if unknown:
            raise ValueError(
                f"generation_overrides {unknown} are not sampling settings here; use {', '.join(OVERRIDABLE)}"
            )
        if given.get("n", 1) != 1:
            raise ValueError("generate_rollout_completions samples one completion per prompt: n must be 1")
        changes = {name: value for name, value in given.items() if name in OVERRIDABLE}
        if "stop" in changes and isinstance(changes["stop"], str):
            changes["stop"] = [changes["stop"]]
        params = dataclasses.replace(self.sampling, **changes)
        if "seed" in changes or self.seed is None:
            return params
        if not self.per_prompt_params:
            return dataclasses.replace(params, seed=self._seeds.getrandbits(62))
        return [dataclasses.replace(params, seed=self._seeds.getrandbits(62)) for _ in range(num_prompts)]


def generate_rollout_completions(
    trainer: RolloutTrainer,
    prompts: Sequence[str | list[dict]],
    *,
    generation_overrides: dict[str, Any] | None = None,
    as_chat: bool | None = None,
) -> list[dict[str, Any]]:
    """One completion per prompt with the run's engine and sampling settings (TRL's helper of the
    same name and call). A text prompt is tokenized as it is; chat messages (or `as_chat`) go
    through the tokenizer's chat template with the generation prompt. Each result holds
    `prompt_ids`, `completion_ids`, `logprobs` (the sampling log-prob of each completion token)
    and `text`."""
    if not prompts:
        return []
    tokenizer = trainer.processing_class
    if as_chat is None:
        as_chat = isinstance(prompts[0], list)
    prompt_ids = [_encode(tokenizer, prompt, as_chat) for prompt in prompts]
    params = trainer.sampling_params(len(prompt_ids), generation_overrides)
    outputs = trainer.engine.generate(prompt_ids, params)
    results = []
    for ids, (completion,) in zip(prompt_ids, outputs, strict=True):
        results.append(
            {
                "prompt_ids": list(ids),
                "completion_ids": list(completion.token_ids),
                "logprobs": list(completion.logprobs),
                "text": tokenizer.decode(completion.token_ids, skip_special_tokens=True),
            }
        )
    return results


def _encode(tokenizer, prompt: str | list[dict], as_chat: bool) -> list[int]:
    if as_chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "generate_rollout_completions got chat prompts, and the tokenizer has no chat template: pass "
                "text prompts, or use a chat model"
            )
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    if not isinstance(prompt, str):
        raise TypeError(
            f"generate_rollout_completions takes text or chat prompts, got {type(prompt).__name__}"
        )
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens")
    return list(ids)
