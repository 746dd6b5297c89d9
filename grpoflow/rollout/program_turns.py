"""An agent program's episode: what is played (its prompt, sampling and seed), and as the server
recorded it: where the turns are read from, read and deleted once the program returns, the turns
the update's exact check cannot count as the policy's draws, and the chained turns as the
completion a group trains on (with where each of its later sequences starts)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpoflow.chat.trajectory import Trajectory
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion, SamplingParams

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A server the programs sample from."""

    url: str
    api_key: str
    model: str


@dataclass(frozen=True, slots=True)
class Episode:
    """One episode to play: its prompt, the run's sampling for it, and its seed."""

    item: PromptItem
    params: SamplingParams
    seed: int | None


def episodes_of(items: list[PromptItem], per_item: list[SamplingParams]) -> list[Episode]:
    """`params.n` episodes per item, in order, each seeded from its item's seed and its index."""
    episodes = []
    for item, params in zip(items, per_item, strict=True):
        for index in range(params.n):
            seed = None if params.seed is None else (params.seed * 1_000_003 + index * 7_919) % 2**62
            episodes.append(Episode(item, params, seed))
    return episodes


def new_episode_id() -> str:
    """An episode id no other client can guess (128 random bits)."""
    return f"agent-{secrets.token_urlsafe(16)}"


async def take_episode(
    fetcher: httpx.AsyncClient, endpoint: Endpoint, episode_id: str, page_turns: int | None = None
) -> list[dict[str, Any]]:
    """An episode's recorded turns, read a page at a time (of the server's size, or `page_turns`)
    and then deleted from the server; [] when it recorded none."""
    headers = {"Authorization": f"Bearer {endpoint.api_key}"}
    url = f"{endpoint.url}/v1/episodes/{episode_id}"
    turns: list[dict[str, Any]] = []
    offset: int | None = 0
    while offset is not None:
        params = {"offset": offset} if page_turns is None else {"offset": offset, "limit": page_turns}
        answer = await fetcher.get(url, headers=headers, params=params)
        if answer.status_code == 404 and not turns:
            return []
        answer.raise_for_status()
        page = answer.json()
        turns += page["turns"]
        following = page.get("next_offset")
        if following is not None and following <= offset:
            raise ValueError(f"{url} answered offset {offset} with next_offset {following}: it must advance")
        offset = following
    (await fetcher.delete(url, headers=headers)).raise_for_status()
    return turns


def unverifiable(
    turns: list[dict[str, Any]], params: SamplingParams
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The turns as the update's exact check may weigh them, and the recorded `sampling` of each
    that is not the policy's draw: a turn whose `sampling` is not the run's distribution (`params`) was
    drawn from another one (a request that reached the server with its own temperature, top_p,
    top_k, min_p or repetition_penalty, or greedy), or one the record does not name, so its
    log-probs are NaN: no log-prob of the policy's draw, which the check counts as a difference,
    leaving its episode out of the loss whatever the engine's scores happen to equal."""
    expected, kept, foreign = params.distribution(), [], []
    for turn in turns:
        if turn.get("sampling") == expected:
            kept.append(turn)
            continue
        foreign.append(turn.get("sampling"))
        kept.append({**turn, "completion_logprobs": [math.nan] * len(turn["completion_ids"])})
    return kept, foreign


def training_completion(trajectory: Trajectory, shared: int) -> tuple[Completion, list[int]]:
    """The trajectory after the group's shared prompt: its own rest of the prompt (mask 0), then
    its turns; and where in the completion each of its later runs starts (`Group.sequence_starts`)."""
    rest = trajectory.prompt_ids[shared:]
    completion = Completion(
        rest + trajectory.ids,
        [0.0] * len(rest) + trajectory.logprobs,
        "length" if trajectory.truncated else "stop",
        trajectory.policy_version,
        mask=[0] * len(rest) + trajectory.mask,
    )
    return completion, [len(rest) + start for start in trajectory.starts]


def common_prefix(sequences: list[list[int]]) -> list[int]:
    if not sequences:
        return []
    length = 0
    for column in zip(*sequences):
        if any(value != column[0] for value in column):
            break
        length += 1
    return list(sequences[0][:length])
