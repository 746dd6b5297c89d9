"""The recorded chat turns of an agent program's episode, made into training sequences.

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

A turn that does not extend the previous one (the program rewrote, trimmed or summarised its
history, or the template renders an earlier turn differently: Qwen3's drops the thinking of turns
before the last user message, tool-call arguments get re-serialised) starts a new run of turns.
Every run is trained, as a sequence of its own: its first turn's prompt (mask 0), then its turns
chained as above. The runs follow each other in `ids`; `starts` says where each later one begins
(the first id of its prompt), and the learner keeps the runs apart (positions restart, no attention
across: `grpoflow.rollout.segments`):

    turn 1:  [prompt_1][completion_1]
    turn 2:  [prompt_2][completion_2]              (prompt_2 does not start with turn 1's ids)
    trained: [prompt_1] + ([completion_1] | [prompt_2]  [completion_2])
                mask        1 ... 1         0 ... 0     1 ... 1
                                            ^ starts

Every sampled id keeps the log-prob it was sampled with; nothing is re-tokenised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

EPISODE_HEADER = "X-Episode-Id"
"""The header that names the episode a chat request belongs to (`grpoflow serve` records it)."""


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One episode's training sequences: its runs of turns, one after the other."""

    prompt_ids: list[int]
    """The first turn's prompt."""
    ids: list[int]
    """Everything after it: sampled ids (mask 1), the ids inserted between turns (mask 0) and the
    prompt of each later run (mask 0)."""
    mask: list[int]
    logprobs: list[float]
    """The sampling log-prob of each sampled id; 0 on the others."""
    starts: list[int]
    """Where in `ids` each run after the first begins (its prompt's first id), in order."""
    num_turns: int
    """Turns in the sequences."""
    num_dropped: int
    """Recorded turns left out: each begins past max_completion_length ids into its run."""
    truncated: bool
    """A run reached max_completion_length ids after its prompt (and was cut there if it ran past
    it). A turn that ends at its own max_tokens does not truncate the episode: the program saw it
    and went on."""
    policy_version: int
    """The oldest policy version that sampled a turn."""

    @property
    def num_segments(self) -> int:
        """The runs of turns: sequences the episode trains as."""
        return 1 + len(self.starts)


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


@dataclass(slots=True)
class _Run:
    """One run's ids after its prompt, cut at max_completion_length."""

    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    num_turns: int = 0
    truncated: bool = False


def _chain_run(turns: Sequence[Mapping[str, Any]], max_completion_length: int) -> _Run:
    prompt_length = len(turns[0]["prompt_ids"])
    run = _Run([], [], [])
    for turn in turns:
        inserted = list(turn["prompt_ids"][prompt_length + len(run.ids) :])
        if len(run.ids) + len(inserted) >= max_completion_length:
            run.truncated = True
            break
        completion = list(turn["completion_ids"])
        run.ids += inserted + completion
        run.mask += [0] * len(inserted) + [1] * len(completion)
        run.logprobs += [0.0] * len(inserted) + [float(value) for value in turn["completion_logprobs"]]
        run.num_turns += 1
    run.truncated = run.truncated or len(run.ids) >= max_completion_length
    del run.ids[max_completion_length:], run.mask[max_completion_length:]
    del run.logprobs[max_completion_length:]
    return run


def chain_turns(turns: Sequence[Mapping[str, Any]], max_completion_length: int) -> Trajectory:
    """The training sequences of an episode's recorded turns (at least one; each a mapping with
    `prompt_ids`, `completion_ids`, `completion_logprobs`, `finish_reason`, `policy_version`, as
    GET /v1/episodes/ID returns them): each run of turns cut at `max_completion_length` ids after
    its own prompt."""
    if not turns:
        raise ValueError("an episode with no recorded turns has no trajectory")
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    starts: list[int] = []
    num_turns, truncated = 0, False
    for index, span in enumerate(chaining_runs(turns)):
        run_turns = [turns[position] for position in span]
        if index:
            prompt = list(run_turns[0]["prompt_ids"])
            starts.append(len(ids))
            ids += prompt
            mask += [0] * len(prompt)
            logprobs += [0.0] * len(prompt)
        run = _chain_run(run_turns, max_completion_length)
        ids, mask, logprobs = ids + run.ids, mask + run.mask, logprobs + run.logprobs
        num_turns += run.num_turns
        truncated = truncated or run.truncated
    return Trajectory(
        prompt_ids=list(turns[0]["prompt_ids"]),
        ids=ids,
        mask=mask,
        logprobs=logprobs,
        starts=starts,
        num_turns=num_turns,
        num_dropped=len(turns) - num_turns,
        truncated=truncated,
        policy_version=min(int(turn["policy_version"]) for turn in turns),
    )
