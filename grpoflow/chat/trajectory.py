"""The recorded chat turns of an agent program's episode, chained into one training sequence.

A server that records an episode (`grpoflow serve`, /v1/episodes) keeps each turn's `prompt_ids`
(the conversation as the chat template rendered it), `completion_ids` and `completion_logprobs`
(what the policy sampled). When a program appends the answer and a tool or user message and asks
again, the template renders the old conversation the same way, so turn k's prompt starts with
turn k-1's prompt and completion; what follows them is the tool's or the user's text, which the
policy did not sample:

    turn 1:  [prompt_1][completion_1]
    turn 2:  [prompt_1][completion_1][inserted][completion_2]
    trained: [prompt_1] + ([completion_1]  [inserted]  [completion_2])
                mask        1 ... 1         0 ... 0     1 ... 1

A turn that does not extend the previous one (the program rewrote or trimmed its history, or the
template renders an earlier turn differently, e.g. tool-call arguments re-serialised) starts a new
run of turns; the sequence is the longest run (the later one on a tie, since a reward judges the
episode's end), and the turns outside it are counted as dropped. Nothing is re-tokenised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

EPISODE_HEADER = "X-Episode-Id"
"""The header that names the episode a chat request belongs to (`grpoflow serve` records it)."""


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One episode's training sequence."""

    prompt_ids: list[int]
    """The first kept turn's prompt."""
    ids: list[int]
    """Everything after it: sampled ids (mask 1) and the ids inserted between turns (mask 0)."""
    mask: list[int]
    logprobs: list[float]
    """The sampling log-prob of each sampled id; 0 on inserted ids."""
    num_turns: int
    """Turns in the sequence."""
    num_dropped: int
    """Recorded turns left out: they are not part of the longest chaining run."""
    truncated: bool
    """The sequence reached max_completion_length (and was cut there if it ran past it). A turn
    that ends at its own max_tokens does not truncate the episode: the program saw it and went on."""
    policy_version: int
    """The oldest policy version that sampled a kept turn."""


def extends(previous: Mapping[str, Any], turn: Mapping[str, Any]) -> bool:
    """Whether `turn`'s prompt starts with `previous`'s prompt and completion."""
    prefix = [*previous["prompt_ids"], *previous["completion_ids"]]
    return len(turn["prompt_ids"]) >= len(prefix) and list(turn["prompt_ids"][: len(prefix)]) == prefix


def chaining_runs(turns: Sequence[Mapping[str, Any]]) -> list[range]:
    """The turns split into runs in which each turn extends the one before it."""
    runs, start = [], 0
    for index in range(1, len(turns)):
        if not extends(turns[index - 1], turns[index]):
            runs.append(range(start, index))
            start = index
    runs.append(range(start, len(turns)))
    return runs


def chain_turns(turns: Sequence[Mapping[str, Any]], max_completion_length: int) -> Trajectory:
    """The training sequence of an episode's recorded turns (at least one; each a mapping with
    `prompt_ids`, `completion_ids`, `completion_logprobs`, `finish_reason`, `policy_version`, as
    GET /v1/episodes/ID returns them), cut at `max_completion_length` ids after its prompt."""
    if not turns:
        raise ValueError("an episode with no recorded turns has no trajectory")
    kept_range = max(chaining_runs(turns), key=lambda run: (len(run), run.start))
    kept = [turns[index] for index in kept_range]
    prompt = list(kept[0]["prompt_ids"])
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for turn in kept:
        inserted = list(turn["prompt_ids"][len(prompt) + len(ids) :])
        completion = list(turn["completion_ids"])
        ids += inserted + completion
        mask += [0] * len(inserted) + [1] * len(completion)
        logprobs += [0.0] * len(inserted) + [float(value) for value in turn["completion_logprobs"]]
    return Trajectory(
        prompt_ids=prompt,
        ids=ids[:max_completion_length],
        mask=mask[:max_completion_length],
        logprobs=logprobs[:max_completion_length],
        num_turns=len(kept),
        num_dropped=len(turns) - len(kept),
        truncated=len(ids) >= max_completion_length,
        policy_version=min(int(turn["policy_version"]) for turn in kept),
    )
