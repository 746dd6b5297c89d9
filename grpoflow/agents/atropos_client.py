"""grpoflow as an Atropos trainer: register with Atropos's trajectory API (`run-api`) and pull the
scored groups its environments post.

Atropos (atroposlib 0.4) environments sample from an inference server, score each group of
completions and post it to the trajectory API; a trainer registers there (`POST /register`), then
polls `GET /batch`, which answers `{"batch": None}` until `batch_size` sequences are queued and then
`{"batch": [group, ...]}`. A group holds per sequence `tokens`, `masks` (the token id where the
token gets a loss, -100 where it gets none: the prompt, and in multi-turn episodes the
environment's turns), `scores`, and optionally `inference_logprobs` (aligned with `tokens`, 1.0 at
untrained positions) and per-sequence `overrides`.

Departures from Atropos's example trainer: a row whose lists disagree in length, that trains no
token or whose score is not a finite number is skipped and logged rather than crashing the run;
fields this client does not carry (`advantages`, `ref_logprobs`, `distill_*`, `images`) are
warned about once rather than silently dropped. Each request has a total deadline
(`atropos_timeout`, not per read: an API that answers a byte at a time is cut off there), and an
answer is read as it arrives up to `atropos_max_batch_bytes`: a larger batch is dropped there,
unparsed, and skipped with the reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from grpoflow.options import require

logger = logging.getLogger("grpoflow.agents.atropos_client")

IGNORED = -100
"""Atropos's mask value for a token that gets no loss."""
WAIT_LOG_SECONDS = 60.0
"""How often a trainer waiting for a batch says so."""
UNCARRIED_FIELDS = ("advantages", "ref_logprobs", "distill_token_ids", "distill_logprobs", "images")
"""Group fields an environment may set that ScoredGroup does not carry."""


@dataclass(kw_only=True, slots=True)
class AtroposConfig:
    """Where the trajectory API runs, what the trainer registers there, and how it polls."""

    atropos_url: str | None = None
    """Base URL of Atropos's trajectory API (`run-api --port 8000`: http://localhost:8000). Set,
    the run trains on the scored groups Atropos environments post there instead of sampling
    prompts itself."""
    atropos_batch_size: int | None = None
    """Sequences (not groups) per batch: the API hands out whole groups adding up to this; unset:
    the run's per_device_train_batch_size x gradient_accumulation_steps."""
    atropos_max_token_len: int = 2048
    """Longest sequence, prompt included; environments drop groups with a sequence this long."""
    atropos_checkpoint_dir: str = ""
    """Directory environments save their checkpoints under; empty: none."""
    atropos_save_checkpoint_interval: int = 0
    """Steps between environment checkpoints; 0: none."""
    atropos_wandb_project: str = ""
    """Weights & Biases project environments log to (Atropos's registration requires a string)."""
    atropos_wandb_group: str = ""
    """Weights & Biases group environments log to."""
    atropos_poll_seconds: float = 1.0
    """Seconds between two polls of /batch while no batch is ready."""
    atropos_timeout: float = 30.0
    """Seconds one HTTP request to the API may take in all (a total deadline, not per read)."""
    atropos_max_batch_bytes: int = 64 * 2**20
    """Most bytes of one answer from the API; a batch larger than this is dropped as it arrives,
    unparsed, and skipped with a warning (its groups are lost)."""
    atropos_max_wait_seconds: float | None = None
    """Seconds the run waits for one batch before it stops (with a checkpoint); unset: forever."""

    def __post_init__(self) -> None:
        url = self.atropos_url
        require(url is None or url.startswith(("http://", "https://")), "atropos_url", "an http(s) URL", url)
        size = self.atropos_batch_size
        require(size is None or size >= 1, "atropos_batch_size", ">= 1 (or unset)", size)
        require(self.atropos_max_token_len >= 1, "atropos_max_token_len", ">= 1", self.atropos_max_token_len)
        size_limit = self.atropos_max_batch_bytes
        require(size_limit >= 1, "atropos_max_batch_bytes", ">= 1", size_limit)
        interval = self.atropos_save_checkpoint_interval
        require(interval >= 0, "atropos_save_checkpoint_interval", ">= 0", interval)
        for name in ("atropos_poll_seconds", "atropos_timeout"):
            require(getattr(self, name) > 0, name, "> 0 (seconds)", getattr(self, name))
        wait = self.atropos_max_wait_seconds
        require(wait is None or wait > 0, "atropos_max_wait_seconds", "> 0 (or unset)", wait)

    @property
    def enabled(self) -> bool:
        """Whether the run trains on Atropos's batches."""
        return self.atropos_url is not None

    def registration(self, num_steps: int, starting_step: int = 0) -> dict[str, Any]:
        """The body of `POST /register` (every field of atroposlib's `Registration`) for a run of
        `num_steps` steps starting at `starting_step` (above 0, environments reload checkpoints)."""
        return {
            "wandb_group": self.atropos_wandb_group,
            "wandb_project": self.atropos_wandb_project,
            "batch_size": self.atropos_batch_size or 1,
            "max_token_len": self.atropos_max_token_len,
            "checkpoint_dir": self.atropos_checkpoint_dir,
            "save_checkpoint_interval": self.atropos_save_checkpoint_interval,
            "starting_step": starting_step,
            "num_steps": num_steps,
        }


@dataclass(slots=True)
class ScoredGroup:
    """One group of sequences an environment scored together; lists run over its sequences."""

    token_ids: list[list[int]]
    """Each sequence's tokens, prompt and completion."""
    loss_mask: list[list[int]]
    """Per token: 1 where it gets a loss (Atropos's mask is not -100), else 0."""
    scores: list[float]
    """Each sequence's score from the environment (not yet an advantage)."""
    logprobs: list[list[float]] | None
    """Sampling log-probs aligned with token_ids (Atropos puts 1.0 where loss_mask is 0); None
    when the environment sent none."""
    prompt_length: list[int]
    """Index of each sequence's first trained token: token_ids[i][:prompt_length[i]] is its prompt."""
    overrides: list[dict] | None = None
    """Per-sequence settings from the environment (e.g. `set_advantage_to_zero`, `temperature`)."""
    env_id: int | None = None
    """Id the API gave the environment that posted the group."""


def groups_from_batch(batch: list[Any], vocab_size: int | None = None) -> list[ScoredGroup]:
    """The groups of a /batch answer's `batch`; malformed groups and rows are logged and skipped
    (`vocab_size`: token ids at or above it are malformed)."""
    groups = []
    for index, raw in enumerate(batch):
        group = scored_group(raw, where=f"batch group {index}", vocab_size=vocab_size)
        if group is not None:
            groups.append(group)
    return groups


def scored_group(raw: Any, where: str = "group", vocab_size: int | None = None) -> ScoredGroup | None:
    """One Atropos group as a ScoredGroup, keeping its well-formed rows; None when none is left."""
    if not isinstance(raw, dict) or not all(
        isinstance(raw.get(key), list) for key in ("tokens", "masks", "scores")
    ):
        logger.warning("skipped %s: it needs lists 'tokens', 'masks' and 'scores'", where)
        return None
    where = f"{where} (env {raw.get('env_id')})"
    columns = {key: raw.get(key) for key in ("tokens", "masks", "scores", "inference_logprobs", "overrides")}
    for key in ("inference_logprobs", "overrides"):
        if columns[key] is not None and not isinstance(columns[key], list):
            logger.warning("skipped %s: its %r is a %s, not a list", where, key, type(columns[key]).__name__)
            return None
    counts = {key: len(value) for key, value in columns.items() if value is not None}
    if len(set(counts.values())) > 1:
        logger.warning("skipped %s: its lists pair no rows, having %s", where, _counts(counts))
        return None
    group = ScoredGroup([], [], [], [] if columns["inference_logprobs"] is not None else None, [])
    group.overrides = [] if columns["overrides"] is not None else None
    group.env_id = raw.get("env_id")
    for row in range(counts["tokens"]):
        values = {key: None if value is None else value[row] for key, value in columns.items()}
        problem = _row_problem(values, vocab_size)
        if problem:
            logger.warning("skipped row %d of %s: %s", row, where, problem)
            continue
        _append(group, values)
    return group if group.token_ids else None


def _row_problem(values: dict[str, Any], vocab_size: int | None = None) -> str:
    """Why a row cannot be trained on, or '' when it can."""
    tokens, masks, score, logprobs = (
        values[key] for key in ("tokens", "masks", "scores", "inference_logprobs")
    )
    if not isinstance(tokens, list) or not all(_is_int(token) for token in tokens):
        return "its tokens are not a list of token ids"
    outside = next((t for t in tokens if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if outside is not None:
        return f"its token id {outside} is outside the vocabulary (0..{vocab_size})"
    if not isinstance(masks, list) or len(masks) != len(tokens):
        return f"it has {len(tokens)} tokens but {_length(masks)} mask values"
    if logprobs is not None and (not isinstance(logprobs, list) or len(logprobs) != len(tokens)):
        return f"it has {len(tokens)} tokens but {_length(logprobs)} inference_logprobs"
    if logprobs is not None:
        problem = _logprob_problem(logprobs, masks)
        if problem:
            return problem
    if all(mask == IGNORED for mask in masks):
        return "every mask value is -100, so no token would be trained"
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        return f"its score {score!r} is not a finite number"
    return ""


def _logprob_problem(logprobs: list, masks: list) -> str:
    """Why a row's inference_logprobs cannot be trained on: a value that is not a number, or a
    trained token's that is not finite (Atropos puts 1.0 at untrained ones)."""
    odd = next((value for value in logprobs if not _is_number(value)), None)
    if odd is not None:
        return f"its inference_logprobs hold {odd!r}, not a number"
    bad = next((v for v, m in zip(logprobs, masks) if m != IGNORED and not math.isfinite(v)), None)
    if bad is not None:
        return f"a trained token's inference_logprob is {bad!r}, not a finite number"
    return ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _append(group: ScoredGroup, values: dict[str, Any]) -> None:
    loss_mask = [int(mask != IGNORED) for mask in values["masks"]]
    group.token_ids.append(list(values["tokens"]))
    group.loss_mask.append(loss_mask)
    group.scores.append(float(values["scores"]))
    group.prompt_length.append(loss_mask.index(1))
    if group.logprobs is not None:
        group.logprobs.append([float(value) for value in values["inference_logprobs"]])
    if group.overrides is not None:
        group.overrides.append(dict(values["overrides"] or {}))


def _length(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else f"no list of ({type(value).__name__})"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{count} {key}" for key, count in counts.items())


class AtroposClient:
    """The trainer's side of Atropos's trajectory API: register, then pull batches of scored groups.

    >>> config = AtroposConfig(atropos_url="http://localhost:8000", atropos_batch_size=64)
    >>> with AtroposClient(config) as client:  # doctest: +SKIP
    ...     client.register(num_steps=100)
    ...     groups = client.next_batch()
    """

    def __init__(self, config: AtroposConfig, *, vocab_size: int | None = None) -> None:
        """`vocab_size`: the policy's token ids (embedding rows); a row with others is skipped."""
        if config.atropos_url is None:
            raise ValueError("AtroposClient needs atropos_url, the address of the trajectory API (run-api)")
        import httpx  # the atropos extra: the core imports this module for AtroposConfig alone

        self.config, self.vocab_size = config, vocab_size
        self.url = config.atropos_url.rstrip("/")
        self.http = httpx.AsyncClient(base_url=self.url, timeout=config.atropos_timeout)
        # Requests run on a loop of the client's own, so that each is cancelled at its deadline.
        self._loop = asyncio.new_event_loop()
        self.trainer_id: int | None = None
        """The id /register answered (Atropos's `uuid`), once registered."""
        self.ignored_fields: set[str] = set()
        """Fields of UNCARRIED_FIELDS seen in a batch (each is warned about once)."""

    def __enter__(self) -> AtroposClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self.http.aclose())
            self._loop.close()

    def register(self, num_steps: int, starting_step: int = 0) -> int:
        """Register as the trainer of a run of `num_steps` steps resuming at `starting_step`, and
        return the API's id for it; warn when another trainer's registration already set the
        batch size or length limit (the API keeps the first)."""
        registration = self.config.registration(num_steps, starting_step)
        answer = self._request("POST", "/register", json=registration)
        self.trainer_id = int(answer["uuid"])
        info = self._request("GET", "/info")
        wanted = {key: registration[key] for key in ("batch_size", "max_token_len")}
        kept = {key: info.get(key) for key in wanted}
        if kept != wanted:
            logger.warning(
                "the Atropos API at %s keeps an earlier registration (%s), not this trainer's (%s): "
                "restart run-api, or GET %s/reset_data, for this run's settings to apply",
                self.url,
                kept,
                wanted,
                self.url,
            )
        return self.trainer_id

    def status(self) -> dict[str, int]:
        """The API's `current_step` (batches handed out) and `queue_size` (groups waiting)."""
        return self._request("GET", "/status")

    def poll_batch(self) -> list[ScoredGroup] | None:
        """One poll of /batch: its groups, or None while fewer than batch-size sequences wait (or
        when the batch was larger than atropos_max_batch_bytes: skipped with a warning)."""
        try:
            answer = self._request("GET", "/batch")
        except AnswerTooLarge as error:
            logger.warning("skipped a batch: %s; polling on", error)
            return None
        if answer.get("status") == "error":
            raise ValueError(
                f"the Atropos API at {self.url} refused the batch request ({answer.get('message')}): "
                "call register() first; after a restart of run-api register again"
            )
        batch = answer.get("batch")
        if batch is None:
            return None
        self._warn_uncarried(batch)
        groups = groups_from_batch(batch, self.vocab_size)
        if not groups:
            logger.warning("a batch from %s held no well-formed group; polling on", self.url)
            return None
        return groups

    def next_batch(self) -> list[ScoredGroup]:
        """Poll every atropos_poll_seconds until a batch is ready (TimeoutError past
        atropos_max_wait_seconds), logging the API's status every WAIT_LOG_SECONDS of waiting."""
        limit = self.config.atropos_max_wait_seconds
        started = time.monotonic()
        deadline = None if limit is None else started + limit
        next_log = started + WAIT_LOG_SECONDS
        while True:
            groups = self.poll_batch()
            if groups is not None:
                return groups
            if time.monotonic() > next_log:
                logger.info(
                    "waiting %.0f s for a batch from the Atropos API at %s (status: %s)",
                    time.monotonic() - started,
                    self.url,
                    self.status(),
                )
                next_log += WAIT_LOG_SECONDS
            if deadline is not None and time.monotonic() + self.config.atropos_poll_seconds > deadline:
                raise TimeoutError(
                    f"no batch from the Atropos API at {self.url} within {limit} s "
                    f"(status: {self.status()}): check that environments are running and posting "
                    "to this API, or raise atropos_max_wait_seconds"
                )
            time.sleep(self.config.atropos_poll_seconds)

    def _warn_uncarried(self, batch: list[Any]) -> None:
        """Warn once per field that environments set and ScoredGroup does not carry."""
        for raw in batch:
            for name in UNCARRIED_FIELDS:
                if isinstance(raw, dict) and raw.get(name) is not None and name not in self.ignored_fields:
                    self.ignored_fields.add(name)
                    logger.warning("Atropos groups carry %r, which grpoflow ignores", name)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON answer of one request, within atropos_timeout in all; errors name the URL and
        what to do (AnswerTooLarge past atropos_max_batch_bytes)."""
        import httpx

        timeout = self.config.atropos_timeout
        call = f"{method} {self.url}{path}"
        try:
            status, body = self._loop.run_until_complete(
                asyncio.wait_for(self._fetch(method, path, kwargs), timeout)
            )
        except httpx.ConnectError:
            raise ValueError(
                f"no Atropos trajectory API answers at {self.url}: start it with `run-api --port PORT` "
                "(atroposlib) and set atropos_url to its address"
            ) from None
        except (httpx.TimeoutException, TimeoutError):
            raise TimeoutError(
                f"{call} got no whole answer within atropos_timeout={timeout:g} s: "
                "check that the API is not stalled, or raise atropos_timeout"
            ) from None
        except AnswerTooLarge as error:
            raise AnswerTooLarge(f"{call} answered {error}") from None
        if status >= 400:
            raise RuntimeError(f"{call} answered {status}: {body[:500].decode('utf-8', 'replace')}")
        try:
            return json.loads(body)
        except ValueError:
            raise RuntimeError(
                f"{call} answered no JSON ({body[:200].decode('utf-8', 'replace')!r}): "
                "is atropos_url the trajectory API (run-api) and not another server?"
            ) from None

    async def _fetch(self, method: str, path: str, kwargs: dict[str, Any]) -> tuple[int, bytearray]:
        """The status and body of one request, read as it arrives up to atropos_max_batch_bytes."""
        limit = self.config.atropos_max_batch_bytes
        async with self.http.stream(method, path, **kwargs) as response:
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise AnswerTooLarge(too_large(f"{int(declared):,} bytes (its Content-Length)", limit))
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    raise AnswerTooLarge(too_large(f"more than {limit:,} bytes", limit))
            return response.status_code, body


class AnswerTooLarge(ValueError):
    """An answer from the API longer than atropos_max_batch_bytes."""


def too_large(size: str, limit: int) -> str:
    return (
        f"{size}, past atropos_max_batch_bytes={limit}: raise atropos_max_batch_bytes, or have the "
        "environments post smaller groups (a lower atropos_batch_size or atropos_max_token_len)"
    )
