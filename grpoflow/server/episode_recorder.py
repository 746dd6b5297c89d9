"""Episodes of black-box agents: the chat turns an agent program samples from the policy, recorded
token-exact, so a trainer can train on an agent it did not write.

An agent written against the `openai` client names its episode in one of two ways:

- the header `X-Episode-Id`: `OpenAI(base_url=..., default_headers={"X-Episode-Id": ID})` (a client
  per episode), or `extra_headers={"X-Episode-Id": ID}` on each call;
- the body field `episode_id`: `client.chat.completions.create(..., extra_body={"episode_id": ID})`.

Both may be sent when they agree. An id is 1 to 256 letters, digits or `._:@-`. Each
/v1/chat/completions request that names an episode (with n=1) adds one turn to it: the request's
`messages` and `tools` (null when the chat template does not read tools), the rendered
`prompt_ids`, the sampled `completion_ids` (the stop token included when one ended the turn) and
their `completion_logprobs` (log_softmax(logits / temperature) of each sampled token, the chat
response's log-probs whether or not the request asked for them), the `sampling` they were drawn
with (temperature, top_p, top_k, min_p, repetition_penalty as the server read them), the
`finish_reason`, the assistant `message` answered and the `policy_version` that sampled it.
Requests without an id are not recorded. The endpoints that read them back are episode_routes.py's.

A turn is kept as it will be sent back: its JSON parts as bytes and its token ids and log-probs as
packed arrays (a long agent's prompts repeat the whole conversation every turn), and its size in
bytes is what the caps count. An episode holds at most `max_turns` turns (one more is a 429) and
`max_bytes` bytes (a turn past it is a 413); at most `max_episodes` episodes and `max_total_bytes`
bytes are kept in all, and recording past either drops the least recently recorded episodes, with
a warning in the log: a trainer fetches and deletes each episode once it ends.

Episodes belong to an owner: the API key a request was sent with where the server has several
(`auth.py`), else one owner shared by all. Each owner sees only its own episodes; another owner's
id is as unknown as one never recorded (the same id sent by two owners makes two episodes), so no
owner relies on the secrecy of its ids alone.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from grpoflow.chat.trajectory import EPISODE_HEADER
from grpoflow.engines.base import Completion, SamplingParams
from grpoflow.server.continuation import Resume
from grpoflow.server.errors import RequestError
from grpoflow.server.protocol import ChatCompletionRequest
from grpoflow.server.responses import LOGPROB_FLOOR

logger = logging.getLogger("grpoflow.server")

EPISODE_ID = re.compile(r"[A-Za-z0-9._:@-]{1,256}")
"""What an episode id may hold: it is a path segment of /v1/episodes/{id}."""
TURN_OVERHEAD_BYTES = 256
"""What a turn costs beyond its parts (ids, reasons, the record itself)."""


def to_json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """What a chat request brings to its episode's next turn, serialised before it generates (so
    its size is known and checked first)."""

    owner: str
    episode_id: str
    messages: bytes
    tools: bytes
    """`null` when the request sent none or the chat template does not read them."""
    sampling: bytes
    """The distribution the turn is drawn from (`SamplingParams.distribution`)."""

    @classmethod
    def of(
        cls,
        owner: str,
        episode_id: str,
        request: ChatCompletionRequest,
        keep_tools: bool,
        params: SamplingParams,
    ) -> TurnRequest:
        """The turn `request` starts, sampled with `params` (the request's, as the server reads them)."""
        tools = request.tools if keep_tools else None
        return cls(
            owner, episode_id, to_json(request.messages), to_json(tools), to_json(params.distribution())
        )

    @property
    def nbytes(self) -> int:
        return len(self.messages) + len(self.tools) + len(self.sampling) + TURN_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class RecordedTurn:
    """One chat completion of an episode, kept as the JSON it is read back as."""

    request: TurnRequest
    head: bytes
    """The turn's scalar fields as a JSON object without its closing brace."""
    message: bytes
    prompt_ids: array  # (prompt,) int32
    completion_ids: array  # (completion,) int32
    completion_logprobs: array  # (completion,) float64

    @classmethod
    def of(
        cls, request: TurnRequest, prompt: list[int], completion: Completion, response: dict
    ) -> RecordedTurn:
        """The turn `request` made, answered with `completion` in `response` (its one choice)."""
        (choice,) = response["choices"]
        scalars = {
            "response_id": response["id"],
            "created": response["created"],
            "finish_reason": choice["finish_reason"],
            "policy_version": completion.policy_version,
        }
        return cls(
            request=request,
            head=to_json(scalars)[:-1],
            message=to_json(choice["message"]),
            prompt_ids=array("i", prompt),
            completion_ids=array("i", completion.token_ids),
            completion_logprobs=array("d", completion.logprobs),
        )

    @property
    def nbytes(self) -> int:
        arrays = (self.prompt_ids, self.completion_ids, self.completion_logprobs)
        return (
            self.request.nbytes
            + len(self.head)
            + len(self.message)
            + sum(a.itemsize * len(a) for a in arrays)
        )

    def to_json(self, index: int) -> bytes:
        """The turn as GET /v1/episodes/ID returns it, `index` its place in the episode."""
        logprobs = [max(value, LOGPROB_FLOOR) for value in self.completion_logprobs]
        return b"".join(
            (
                self.head,
                b',"index":%d,"messages":' % index,
                self.request.messages,
                b',"tools":',
                self.request.tools,
                b',"sampling":',
                self.request.sampling,
                b',"prompt_ids":',
                to_json(self.prompt_ids.tolist()),
                b',"completion_ids":',
                to_json(self.completion_ids.tolist()),
                b',"completion_logprobs":',
                to_json(logprobs),
                b',"message":',
                self.message,
                b"}",
            )
        )


@dataclass(slots=True)
class Episode:
    turns: list[RecordedTurn] = field(default_factory=list)
    nbytes: int = 0
    resume_text: str | None = None
    """The text the next turn's prompt may extend (continuation.py); its size counts in `nbytes`."""


class EpisodeRecorder:
    """The recorded episodes by owner and id, least recently recorded first, within the caps."""

    def __init__(self, *, max_episodes: int, max_turns: int, max_bytes: int, max_total_bytes: int) -> None:
        self.max_episodes, self.max_turns = max_episodes, max_turns
        self.max_bytes, self.max_total_bytes = max_bytes, max_total_bytes
        self._episodes: OrderedDict[tuple[str, str], Episode] = OrderedDict()
        self.nbytes = 0
        """Bytes of all recorded turns."""
        self.num_dropped = 0
        """Episodes dropped past max_episodes or max_total_bytes since the server started."""

    def __len__(self) -> int:
        return len(self._episodes)

    def admit(self, request: TurnRequest, nbytes: int | None = None) -> None:
        """Refuse a turn its episode has no room for (429 past max_turns, 413 past max_bytes):
        `request` before it generates, `nbytes` the whole turn's size once it has."""
        nbytes = request.nbytes if nbytes is None else nbytes
        episode = self._episodes.get((request.owner, request.episode_id), Episode())
        if len(episode.turns) >= self.max_turns:
            raise RequestError(
                f"episode {request.episode_id!r} already has {len(episode.turns)} turns, this server's "
                f"cap (--max-episode-turns {self.max_turns}): fetch and delete it, or start another",
                429,
                "episode_id",
            )
        if episode.nbytes + nbytes > self.max_bytes:
            raise RequestError(
                f"episode {request.episode_id!r} would hold {episode.nbytes + nbytes} bytes with "
                f"this turn, past this server's cap of {self.max_bytes} (--max-episode-bytes): fetch "
                f"and delete it, or send fewer or smaller messages and tools",
                413,
                "episode_id",
            )

    def record(self, turn: RecordedTurn, resume_text: str | None = None) -> None:
        """Add `turn` to its episode (checked again: other turns may have landed meanwhile), with
        the `resume_text` the next turn may extend, then drop the least recently recorded episodes
        past max_episodes or max_total_bytes."""
        request = turn.request
        key = (request.owner, request.episode_id)
        previous = self._episodes.get(key)
        replaced = len(previous.resume_text or "") if previous is not None else 0
        nbytes = turn.nbytes + len(resume_text or "") - replaced
        self.admit(request, nbytes)
        episode = self._episodes.setdefault(key, Episode())
        episode.turns.append(turn)
        episode.resume_text = resume_text
        episode.nbytes += nbytes
        self.nbytes += nbytes
        self._episodes.move_to_end(key)
        while len(self._episodes) > self.max_episodes or self.nbytes > self.max_total_bytes:
            (_, dropped), gone = self._episodes.popitem(last=False)
            self.nbytes -= gone.nbytes
            self.num_dropped += 1
            logger.warning(
                "dropped episode %r (%d turns, %d bytes, the least recently recorded): more than "
                "max_recorded_episodes=%d episodes or max_recorded_bytes=%d bytes are recorded; GET then "
                "DELETE /v1/episodes/ID once an episode ends",
                dropped,
                len(gone.turns),
                gone.nbytes,
                self.max_episodes,
                self.max_total_bytes,
            )

    def resume(self, owner: str, episode_id: str) -> Resume | None:
        """What the episode's next turn may build on: its last turn's text and ids; None for an
        episode not recorded yet."""
        episode = self._episodes.get((owner, episode_id))
        if episode is None or episode.resume_text is None:
            return None
        last = episode.turns[-1]
        ids = array("i", last.prompt_ids)
        ids.extend(last.completion_ids)
        return Resume(episode.resume_text, ids)

    def turns(self, owner: str, episode_id: str) -> list[RecordedTurn]:
        """The episode's turns in the order they were answered; a 404 for an id `owner` has not
        recorded (whoever else has)."""
        episode = self._episodes.get((owner, episode_id))
        if episode is None:
            raise RequestError(
                f"no episode {episode_id!r} is recorded here: it was never recorded, was deleted, "
                f"or was dropped past max_recorded_episodes={self.max_episodes} or "
                f"max_recorded_bytes={self.max_total_bytes}",
                404,
                "episode_id",
            )
        return episode.turns

    def drop(self, owner: str, episode_id: str) -> None:
        self.turns(owner, episode_id)
        self.nbytes -= self._episodes.pop((owner, episode_id)).nbytes

    def summary(self, owner: str, offset: int, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """`owner`'s episodes from `offset`, at most `limit`, and whether more follow."""
        mine = (
            {"id": key, "num_turns": len(episode.turns)}
            for (holder, key), episode in self._episodes.items()
            if holder == owner
        )
        page = list(itertools.islice(mine, offset, offset + limit + 1))
        return page[:limit], len(page) > limit


def episode_id_of(request: Request, body: ChatCompletionRequest) -> str | None:
    """The episode a chat request names (its header or its `episode_id`), checked; None: none."""
    header, field_value = request.headers.get(EPISODE_HEADER), body.episode_id
    if header is not None and field_value is not None and header != field_value:
        raise RequestError(
            f"the {EPISODE_HEADER} header ({header!r}) and episode_id ({field_value!r}) differ: send one",
            400,
            "episode_id",
        )
    episode_id = header if header is not None else field_value
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
