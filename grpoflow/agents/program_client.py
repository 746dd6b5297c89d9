"""The `openai` client an agent program gets for one episode: pointed at the policy, naming the
episode in every request, and sampling the way the run samples.

Its HTTP transport rewrites each chat completion request before it leaves: the run's
`temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` replace whatever the program
sent (the recorded log-probs are then the policy's under the distribution the trainer corrects
for), `max_tokens` is capped by `max_turn_tokens` and by what the episode has left of
`max_completion_length` (counted from the server's `usage`: the last turn's prompt and
completion, less the first turn's prompt), and a seed per turn derived from the prompt's keeps a
seeded run reproducible. Messages, tools, `tool_choice`, stops and the chat template stay the
program's. A request past the budget, or after the episode has ended (its timeout, the end of the
rollout), is answered here with a 400 and never reaches the server; one the server refuses for
its context (`max_tokens` past max_model_len) spends the budget as well. A request sent past this
transport keeps its own sampling; the server records it with the turn, and under the update's
exact check such a turn is never counted as the policy's draw (`grpoflow.rollout.program_turns`).

Needs `openai` (and its `httpx`): import this module only when an agent program runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from grpoflow.chat.trajectory import EPISODE_HEADER

CONNECTIONS_PER_POOL = 16
"""Connections in one of the episodes' shared pools (SharedConnections)."""

DISTRIBUTION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""Request fields the run decides: they shape the distribution the log-probs are taken under."""


@dataclass(frozen=True, slots=True)
class RunSampling:
    """How the run samples: what every turn of an episode is rewritten to."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_completion_length: int
    """Tokens an episode may take after its first prompt, its inserted messages included."""
    max_turn_tokens: int | None = None
    """Most tokens per turn; unset: what the episode has left."""

    def fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in DISTRIBUTION_FIELDS}


@dataclass(slots=True)
class EpisodeBudget:
    """One episode's turns as the client saw them: how many, and how many tokens they used."""

    sampling: RunSampling
    seed: int | None = None
    """The episode's seed (from its prompt's); each turn samples with one derived from it."""
    turns: int = 0
    first_prompt_tokens: int = 0
    last_total_tokens: int = 0
    """The last turn's prompt plus completion."""
    exhausted: bool = False
    """A request was refused because max_completion_length was used up."""
    closed: bool = False
    """The episode has ended; later requests are refused."""
    refusals: list[str] = field(default_factory=list)

    @property
    def used(self) -> int:
        return self.last_total_tokens - self.first_prompt_tokens if self.turns else 0

    def rewrite(self, body: dict[str, Any]) -> dict[str, Any] | str:
        """The request as the run samples it, or why it is refused."""
        if self.closed:
            return self._refuse(
                "this episode has ended (it ran past agent_timeout, or its rollout is over): "
                "start no new turns"
            )
        remaining = self.sampling.max_completion_length - self.used
        if remaining < 1:
            self.exhausted = True
            return self._refuse(
                f"the episode has used its max_completion_length={self.sampling.max_completion_length} "
                "tokens: end the episode"
            )
        cap = min(remaining, self.sampling.max_turn_tokens or remaining)
        asked = _asked_max_tokens(body)
        rewritten = {**body, **self.sampling.fields(), "max_tokens": min(asked, cap) if asked else cap}
        rewritten.pop("max_completion_tokens", None)
        if self.seed is not None:
            rewritten["seed"] = (self.seed * 1_000_003 + self.turns) % 2**62
        return rewritten

    def record(self, status: int, content: bytes) -> None:
        """Count an answered turn's tokens from its `usage`; a conversation the server's context
        cannot hold with the turn's max_tokens spends the budget too."""
        if status == 400 and _names_max_tokens(content):
            self.exhausted = True
        if status != 200:
            return
        try:
            usage = json.loads(content)["usage"]
            prompt, completion = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
        except (ValueError, KeyError, TypeError):
            return
        if self.turns == 0:
            self.first_prompt_tokens = prompt
        self.last_total_tokens = prompt + completion
        self.turns += 1

    def _refuse(self, message: str) -> str:
        self.refusals.append(message)
        return message


def _names_max_tokens(content: bytes) -> bool:
    try:
        return json.loads(content)["error"]["param"] == "max_tokens"
    except (ValueError, KeyError, TypeError):
        return False


def _asked_max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def _is_chat(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.endswith("/chat/completions")


def _rewritten(request: httpx.Request, budget: EpisodeBudget) -> httpx.Request | httpx.Response:
    """The request to send, or the 400 answering it here."""
    try:
        body = json.loads(request.content)
    except (ValueError, UnicodeDecodeError):
        return request  # the server names what is wrong with it
    if not isinstance(body, dict):
        return request
    rewritten = budget.rewrite(body)
    if isinstance(rewritten, str):
        error = {"message": rewritten, "type": "BadRequestError", "param": None, "code": 400}
        return httpx.Response(400, json={"error": error}, request=request)
    headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
    return httpx.Request(
        request.method,
        request.url,
        headers=headers,
        content=json.dumps(rewritten).encode(),
        extensions=request.extensions,
    )


def _answer(response: httpx.Response, content: bytes, request: httpx.Request) -> httpx.Response:
    """A read response handed back whole (its body is decoded already)."""
    headers = [
        (k, v) for k, v in response.headers.raw if k.lower() not in (b"content-encoding", b"content-length")
    ]
    return httpx.Response(response.status_code, headers=headers, content=content, request=request)


class AsyncEpisodeTransport(httpx.AsyncBaseTransport):
    """Rewrites an episode's chat requests (module docstring); other requests pass unchanged, and
    all go through `inner`, the connection pool every episode shares (closing the episode's
    client leaves it open)."""

    def __init__(self, budget: EpisodeBudget, inner: httpx.AsyncBaseTransport) -> None:
        self.budget, self.inner = budget, inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not _is_chat(request):
            return await self.inner.handle_async_request(request)
        await request.aread()
        outgoing = _rewritten(request, self.budget)
        if isinstance(outgoing, httpx.Response):
            return outgoing
        response = await self.inner.handle_async_request(outgoing)
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        self.budget.record(response.status_code, content)
        return _answer(response, content, request)


class EpisodeTransport(httpx.BaseTransport):
    """The synchronous twin of AsyncEpisodeTransport, for programs run in a thread."""

    def __init__(self, budget: EpisodeBudget, inner: httpx.BaseTransport) -> None:
        self.budget, self.inner = budget, inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not _is_chat(request):
            return self.inner.handle_request(request)
        request.read()
        outgoing = _rewritten(request, self.budget)
        if isinstance(outgoing, httpx.Response):
            return outgoing
        response = self.inner.handle_request(outgoing)
        try:
            content = response.read()
        finally:
            response.close()
        self.budget.record(response.status_code, content)
        return _answer(response, content, request)


class SharedConnections:
    """The connection pools episodes' clients send through: made once (a pool builds an SSL
    context, tens of milliseconds, and keeps its connections alive between episodes) and handed
    out in turn, CONNECTIONS_PER_POOL connections each (a pool looks through all its connections
    for every request it sends, so one pool for hundreds of episodes would spend more time there
    than on the request), enough of them for `concurrency` episodes at once. The asynchronous
    pools are made on first use, in the loop that uses them."""

    def __init__(self, concurrency: int) -> None:
        self.num_pools = -(-concurrency // CONNECTIONS_PER_POOL)
        per_pool = -(-concurrency // self.num_pools) + 2
        self.limits = httpx.Limits(max_connections=per_pool, max_keepalive_connections=per_pool)
        self._async: list[httpx.AsyncHTTPTransport] = []
        self._sync: list[httpx.HTTPTransport] = []
        self._turn = 0

    def asynchronous(self) -> httpx.AsyncHTTPTransport:
        return self._next(self._async, httpx.AsyncHTTPTransport)

    def synchronous(self) -> httpx.HTTPTransport:
        return self._next(self._sync, httpx.HTTPTransport)

    def _next(self, pools: list, make: Callable[..., Any]) -> Any:
        self._turn += 1
        if len(pools) < self.num_pools:
            pools.append(make(limits=self.limits))
        return pools[self._turn % len(pools)]

    async def aclose(self) -> None:
        for pool in self._async:
            await pool.aclose()
        for pool in self._sync:
            pool.close()
        self._async, self._sync = [], []


def episode_client(
    base_url: str,
    api_key: str,
    episode_id: str,
    budget: EpisodeBudget,
    connections: SharedConnections,
    *,
    asynchronous: bool,
    timeout: float,
):
    """An `openai.AsyncOpenAI` (or `openai.OpenAI`) for one episode: `base_url` (…/v1), the
    episode's id as a default header, no retries (a retried turn would be recorded twice), sending
    through the shared `connections`."""
    import openai

    options = dict(
        base_url=base_url,
        api_key=api_key,
        default_headers={EPISODE_HEADER: episode_id},
        max_retries=0,
        timeout=timeout,
    )
    if asynchronous:
        transport = AsyncEpisodeTransport(budget, connections.asynchronous())
        return openai.AsyncOpenAI(
            **options, http_client=httpx.AsyncClient(transport=transport, timeout=timeout)
        )
    transport = EpisodeTransport(budget, connections.synchronous())
    return openai.OpenAI(**options, http_client=httpx.Client(transport=transport, timeout=timeout))
