"""One episode's trajectory, kept as the exact token ids the engine saw.

`ids` grows by what the policy sampled (mask 1, with the engine's log-probs) and by what the
environment said (mask 0, log-prob 0); the engine's prompt for the next turn is always
`prompt_ids + ids`, so training sees the very sequence that was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion

FINISH_REASONS = ("stop", "length", "max_turns", "max_tool_calling_iterations", "budget", "error")
"""Why an episode ended: the policy stopped (no tool call, the environment had nothing to add);
its token budget ran out mid-turn (truncated); a turn limit; the environment's next message did
not fit in max_completion_length; an environment error (the episode gets no reward)."""


@dataclass(slots=True)
class Episode:
    item: PromptItem
    prompt: str | list[dict]
    """The prompt after the environment's `reset` added to it."""
    prompt_ids: list[int]
    environment: Any = None
    index: int = 0
    """Its place in its group."""
    tools: list[Any] = field(default_factory=list)
    """The functions it may call (the run's tools, then its environment's)."""
    tool_schemas: list[dict] = field(default_factory=list)
    """Their JSON schemas, made once when the episode starts."""
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    """Per token of `ids`: the key the engine drew it with (seeded turns), 0 for the environment's."""
    messages: list[dict] = field(default_factory=list)
    """The turns after the prompt: assistant, tool and user messages."""
    turns: int = 0
    tool_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    environment_seconds: float = 0.0
    finish: str | None = None
    error: str | None = None
    policy_version: int = 0

    @property
    def engine_prompt(self) -> list[int]:
        return self.prompt_ids + self.ids

    def add_policy(
        self,
        token_ids: list[int],
        logprobs: list[float],
        text: str,
        version: int,
        keys: list[int] | None = None,
    ) -> None:
        self.ids += token_ids
        self.keys += keys if keys is not None else [0] * len(token_ids)
        self.mask += [1] * len(token_ids)
        self.logprobs += logprobs
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1
        self.policy_version = version

    def add_environment(self, token_ids: list[int], messages: list[dict]) -> None:
        self.ids += token_ids
        self.keys += [0] * len(token_ids)
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.messages += messages

    def end(self, reason: str, error: str | None = None) -> None:
        if self.finish is None:
            self.finish, self.error = reason, error

    def completion(self, shared: int | None = None) -> Completion:
        """The trajectory after the prompt, as the trainer takes it; an episode that failed is
        empty (its rewards are dropped), its error as its text. `shared`: the length of the
        prompt its group trains with; its own prompt's tokens after that lead the completion
        (mask 0)."""
        if self.finish == "error":
            return Completion([], [], "error", self.policy_version, text=self.error, mask=[])
        rest = self.prompt_ids[len(self.prompt_ids) if shared is None else shared :]
        finish = "length" if self.finish == "length" else "stop"
        return Completion(
            rest + self.ids,
            [0.0] * len(rest) + self.logprobs,
            finish,
            self.policy_version,
            mask=[0] * len(rest) + self.mask,
        )
