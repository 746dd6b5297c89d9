"""Episodes of black-box agents: the chat turns an agent program samples from the policy, recorded
token-exact, so a trainer can train on an agent it did not write.

An agent written against the `openai` client names its episode in one of two ways:

- the header `X-Episode-Id`: `OpenAI(base_url=..., default_headers={"X-Episode-Id": ID})` (a client
  per episode), or `extra_headers={"X-Episode-Id": ID}` on each call;
- the body field `episode_id`: `client.chat.completions.create(..., extra_body={"episode_id": ID})`.

Both may be sent when they agree. An id is 1 to 256 letters, digits or `._:@-`. Each
/v1/chat/completions request that names an episode (with n=1) adds one turn to it: the request's
`messages` and `tools`, the rendered `prompt_ids`, the sampled `completion_ids` (the stop token
included when one ended the turn) and their `completion_logprobs` (log_softmax(logits / temperature) of each sampled token, the chat
response's log-probs whether or not the request asked for them), the `finish_reason`, the assistant
`message` answered and the `policy_version` that sampled it. Requests without an id are not recorded.

- GET /v1/episodes: the recorded episodes' ids and turn counts, least recently recorded first.
- GET /v1/episodes/{id}: `{"id", "object": "episode", "num_turns", "turns": [...]}`.
- DELETE /v1/episodes/{id}: drops the episode (`{"id", "object": "episode", "deleted": true}`).

An unknown id is a 404 naming it. At most `max_recorded_episodes` episodes are kept; recording one
more drops the least recently recorded, with a warning in the log: a trainer fetches and deletes
each episode once it ends.
"""

from __future__ import annotations

import logging
import re
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request

from grpoflow.chat.trajectory import EPISODE_HEADER
from grpoflow.engines.base import Completion
from grpoflow.server.errors import RequestError
from grpoflow.server.protocol import ChatCompletionRequest
from grpoflow.server.responses import LOGPROB_FLOOR

logger = logging.getLogger("grpoflow.server")

EPISODE_ID = re.compile(r"[A-Za-z0-9._:@-]{1,256}")
"""What an episode id may hold: it is a path segment of /v1/episodes/{id}."""

router = APIRouter()


@dataclass(frozen=True, slots=True)
class RecordedTurn:
    """One chat completion of an episode. Token ids and log-probs are kept as packed arrays (a
    long agent's prompts repeat the whole conversation every turn)."""

    response_id: str
    created: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: array  # (prompt,) int32
    completion_ids: array  # (completion,) int32
    completion_logprobs: array  # (completion,) float64
    finish_reason: str
    message: dict[str, Any]
    policy_version: int

    @classmethod
    def of(
        cls, request: ChatCompletionRequest, prompt: list[int], completion: Completion, response: dict
    ) -> RecordedTurn:
        """The turn `request` made, answered with `completion` in `response` (its one choice)."""
        (choice,) = response["choices"]
        return cls(
            response_id=response["id"],
            created=response["created"],
            messages=request.messages,
            tools=request.tools,
            prompt_ids=array("i", prompt),
            completion_ids=array("i", completion.token_ids),
            completion_logprobs=array("d", completion.logprobs),
            finish_reason=choice["finish_reason"],
            message=choice["message"],
            policy_version=completion.policy_version,
        )

    def to_json(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "response_id": self.response_id,
            "created": self.created,
            "messages": self.messages,
            "tools": self.tools,
            "prompt_ids": self.prompt_ids.tolist(),
            "completion_ids": self.completion_ids.tolist(),
            "completion_logprobs": [max(value, LOGPROB_FLOOR) for value in self.completion_logprobs],
            "finish_reason": self.finish_reason,
            "message": self.message,
            "policy_version": self.policy_version,
        }


class EpisodeRecorder:
    """The recorded episodes by id, at most `max_episodes`, least recently recorded first."""

    def __init__(self, max_episodes: int) -> None:
        self.max_episodes = max_episodes
        self._episodes: OrderedDict[str, list[RecordedTurn]] = OrderedDict()
        self.num_dropped = 0
        """Episodes dropped past max_episodes since the server started."""

    def __len__(self) -> int:
        return len(self._episodes)

    def record(self, episode_id: str, turn: RecordedTurn) -> None:
        self._episodes.setdefault(episode_id, []).append(turn)
        self._episodes.move_to_end(episode_id)
        while len(self._episodes) > self.max_episodes:
            dropped, turns = self._episodes.popitem(last=False)
            self.num_dropped += 1
            logger.warning(
                "dropped episode %r (%d turns, the least recently recorded): more than "
                "max_recorded_episodes=%d are recorded; GET then DELETE /v1/episodes/ID once an episode ends",
                dropped,
                len(turns),
                self.max_episodes,
            )

    def turns(self, episode_id: str) -> list[RecordedTurn]:
        """The episode's turns in the order they were answered; a 404 for an unknown id."""
        if episode_id not in self._episodes:
            raise RequestError(
                f"no episode {episode_id!r} is recorded here: it was never recorded, was deleted, "
                f"or was dropped past max_recorded_episodes={self.max_episodes}",
                404,
                "episode_id",
            )
        return self._episodes[episode_id]

    def drop(self, episode_id: str) -> None:
        self.turns(episode_id)
        del self._episodes[episode_id]

    def summary(self) -> list[dict[str, Any]]:
        return [{"id": key, "num_turns": len(turns)} for key, turns in self._episodes.items()]


def episode_id_of(request: Request, body: ChatCompletionRequest) -> str | None:
    """The episode a chat request names (its header or its `episode_id`), checked; None: none."""
    header, field = request.headers.get(EPISODE_HEADER), body.episode_id
    if header is not None and field is not None and header != field:
        raise RequestError(
            f"the {EPISODE_HEADER} header ({header!r}) and episode_id ({field!r}) differ: send one",
            400,
            "episode_id",
        )
    episode_id = header if header is not None else field
    if episode_id is None:
        return None
    if not EPISODE_ID.fullmatch(episode_id):
        raise RequestError(
            f"episode id {episode_id[:300]!r} must be 1 to 256 letters, digits or '._:@-'", 400, "episode_id"
        )
    if body.n != 1:
        raise RequestError(
            f"n={body.n}: an episode records one completion per turn; send n=1 with an episode id",
            400,
            "n",
        )
    return episode_id


def _recorder(request: Request) -> EpisodeRecorder:
    return request.app.state.service.episodes


@router.get("/v1/episodes")
async def list_episodes(request: Request) -> dict:
    return {"object": "list", "data": _recorder(request).summary()}


@router.get("/v1/episodes/{episode_id}")
async def get_episode(request: Request, episode_id: str) -> dict:
    turns = _recorder(request).turns(episode_id)
    return {
        "id": episode_id,
        "object": "episode",
        "num_turns": len(turns),
        "turns": [turn.to_json(index) for index, turn in enumerate(turns)],
    }


@router.delete("/v1/episodes/{episode_id}")
async def delete_episode(request: Request, episode_id: str) -> dict:
    _recorder(request).drop(episode_id)
    return {"id": episode_id, "object": "episode", "deleted": True}
