"""The HTTP side of recorded agent episodes (episode_recorder.py): the turn a chat request adds,
and the endpoints that read episodes back a page at a time, each serialised off the event loop.

- GET /v1/episodes?offset=&limit=: the caller's episodes (`{"id", "num_turns"}`), least recently
  recorded first, at most `limit` (MAX_LIST_PAGE, the default) from `offset`; `has_more` says
  whether more follow.
- GET /v1/episodes/{id}?offset=&limit=: `{"id", "object": "episode", "num_turns", "offset",
  "next_offset", "turns": [...]}`: the turns from `offset`, at most `limit` (MAX_TURNS_PAGE, the
  default) and no more than fit in PAGE_BYTES (one at least); `next_offset` is where the next
  page starts, null after the last turn.
- DELETE /v1/episodes/{id}: drops the episode (`{"id", "object": "episode", "deleted": true}`).

An id the caller has not recorded is a 404 naming it.
"""

from __future__ import annotations

import functools

import jinja2
from fastapi import APIRouter, Query
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from starlette.requests import Request
from starlette.responses import Response

from grpoflow.engines.base import Completion, SamplingParams
from grpoflow.server.auth import owner_of
from grpoflow.server.continuation import Resume, resume_text
from grpoflow.server.episode_recorder import RecordedTurn, TurnRequest, to_json
from grpoflow.server.pools import run_in
from grpoflow.server.protocol import ChatCompletionRequest
from grpoflow.server.service import service_of

MAX_LIST_PAGE = 1024
"""Most episodes one GET /v1/episodes lists."""
MAX_TURNS_PAGE = 256
"""Most turns one GET /v1/episodes/ID returns."""
PAGE_BYTES = 16 * 2**20
"""A page of turns stops once it reaches this size (a single larger turn is sent alone)."""

router = APIRouter()


async def open_turn(
    request: Request, episode_id: str, body: ChatCompletionRequest, params: SamplingParams
) -> TurnRequest:
    """The turn `body` starts in its episode, sampled with `params`, refused before it generates
    when the episode has no room for it."""
    service = service_of(request)
    turn = await run_in(
        service.pools.requests, _turn_request, owner_of(request), episode_id, body, params, service.tokenizer
    )
    service.episodes.admit(turn)
    return turn


def resume_of(request: Request, episode_id: str | None) -> Resume | None:
    """What the episode's next turn may build on (continuation.py); None without an episode."""
    if episode_id is None:
        return None
    return service_of(request).episodes.resume(owner_of(request), episode_id)


async def record_turn(
    request: Request,
    turn: TurnRequest,
    body: ChatCompletionRequest,
    prompt: tuple[str, list[int]],
    completion: Completion,
    response: dict,
) -> None:
    """Record the turn `turn` started with the `prompt` (text, ids) of `body`, answered with
    `completion` in `response`."""
    service = service_of(request)
    text, ids = prompt
    recorded = await run_in(
        service.pools.requests, _recorded, turn, body, text, ids, completion, response, service.tokenizer
    )
    service.episodes.record(*recorded)


def _recorded(
    turn: TurnRequest,
    body: ChatCompletionRequest,
    text: str,
    ids: list[int],
    completion: Completion,
    response: dict,
    tokenizer,
) -> tuple[RecordedTurn, str]:
    following = resume_text(text, completion, tokenizer, body.skip_special_tokens)
    return RecordedTurn.of(turn, ids, completion, response), following


def _turn_request(
    owner: str, episode_id: str, body: ChatCompletionRequest, params: SamplingParams, tokenizer
) -> TurnRequest:
    return TurnRequest.of(owner, episode_id, body, template_reads_tools(body, tokenizer), params)


def template_reads_tools(body: ChatCompletionRequest, tokenizer) -> bool:
    """Whether the chat template that renders `body` reads its `tools` at all (true when unsure;
    a template that never names them renders the same without them, so they are not kept)."""
    if not body.tools:
        return True
    if body.chat_template is not None:
        return _names_tools(body.chat_template)
    try:
        template = tokenizer.get_chat_template(None, tools=body.tools)
    except (ValueError, TypeError):
        return True
    return _own_template_names_tools(template)


@functools.lru_cache(maxsize=4)
def _own_template_names_tools(template: str) -> bool:
    return _names_tools(template)


def _names_tools(template: str) -> bool:
    environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in meta.find_undeclared_variables(environment.parse(template))
    except jinja2.TemplateError:
        return True


@router.get("/v1/episodes")
async def list_episodes(
    request: Request,
    offset: int = Query(0, ge=0),
    limit: int = Query(MAX_LIST_PAGE, ge=1, le=MAX_LIST_PAGE),
) -> dict:
    data, has_more = service_of(request).episodes.summary(owner_of(request), offset, limit)
    return {"object": "list", "data": data, "offset": offset, "has_more": has_more}


@router.get("/v1/episodes/{episode_id}")
async def get_episode(
    request: Request,
    episode_id: str,
    offset: int = Query(0, ge=0),
    limit: int = Query(MAX_TURNS_PAGE, ge=1, le=MAX_TURNS_PAGE),
) -> Response:
    service = service_of(request)
    turns = service.episodes.turns(owner_of(request), episode_id)
    window = turns[offset : offset + limit]
    page = await run_in(service.pools.requests, episode_page, episode_id, len(turns), offset, window)
    return Response(page, media_type="application/json")


def episode_page(episode_id: str, num_turns: int, offset: int, turns: list[RecordedTurn]) -> bytes:
    """The JSON of `turns` (the episode's from `offset`) up to PAGE_BYTES, as GET returns them."""
    parts, size = [], 0
    for index, turn in enumerate(turns, offset):
        if parts and size >= PAGE_BYTES:
            break
        parts.append(turn.to_json(index))
        size += len(parts[-1])
    end = offset + len(parts)
    head = {
        "id": episode_id,
        "object": "episode",
        "num_turns": num_turns,
        "offset": offset,
        "next_offset": end if end < num_turns else None,
    }
    return to_json(head)[:-1] + b',"turns":[' + b",".join(parts) + b"]}"


@router.delete("/v1/episodes/{episode_id}")
async def delete_episode(request: Request, episode_id: str) -> dict:
    service_of(request).episodes.drop(owner_of(request), episode_id)
    return {"id": episode_id, "object": "episode", "deleted": True}
