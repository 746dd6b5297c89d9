"""A rollout server's side of the collective weight transfer (the wire layer is `collective.py`).

`CollectiveReceiver.join(init_info)` joins the trainer's group with `{"backend": "gloo" | "nccl",
"master_address", "master_port", "rank_offset", "world_size", "timeout", "group_id", "secret"}` as
rank `rank_offset` (TRL's and vLLM's field names; a missing backend means NCCL on a CUDA device, gloo on
a CPU one). The join runs in a daemon thread of its own (one join at a time; another meanwhile
is refused with 409) and gives up after `timeout` seconds (default 120, at most 300 whatever the
client sends), so the caller's event loop and generation keep serving. A new join replaces the old
group; `close` leaves it. A failed join's answer does not repeat what the remote end sent. Connecting to the
store, the rendezvous and the challenge share one deadline, so a join holds its slot for at most
`timeout` seconds. With a `secret` (grpoflow's trainer always sends one) the group's keys live
under a name derived from it (`collective.store_prefix`: the secret itself is never in the store)
and the join answers the trainer's challenge with its proof (`collective.challenge`), so the
trainer knows the rank is this server.

`CollectiveReceiver.receive(update_info, ...)` takes `{"names", "dtype_names", "shapes", "packed":
true, "buckets", "update_id", "group_id", "weight_version", "timeout"}`, checks every name and shape
against the model before anything is received (a bad update is refused and changes nothing), then,
in a daemon thread of its own while generation goes on, answers the trainer's handshake and
receives the buckets into buffers of their own, checked (finite, within the parameters' dtypes and magnitudes: a
bad update is refused whole, the old weights stay). Only then, inside the caller's `exclusive`
(between generation batches), `write` puts them in place: copied into the parameters
(`into_parameters`) or handed to a `load` in one call (`into_load`). Generation is thus held for
the copy alone. A stalled broadcast fails after `timeout` seconds (default 600): the group is
closed (join again), and nothing of the update was applied.

Failures raise ReceiveError with the HTTP status a server answers with.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from grpoflow.threads import in_daemon_thread
from grpoflow.transport import ReceiveError, collective
from grpoflow.transport.collective import TransferCancelled, TransferTimeout, UpdatePlan, WeightGroup
from grpoflow.transport.weight_values import check_update_values

logger = logging.getLogger("grpoflow.transport")

DEFAULT_INIT_TIMEOUT_S = 120.0
MAX_INIT_TIMEOUT_S = 300.0
"""Longest a join may wait, whatever `timeout` the client sends."""
DEFAULT_UPDATE_TIMEOUT_S = 600.0
MAX_UPDATE_TIMEOUT_S = 3600.0
"""Longest an update's broadcast may stall, whatever `timeout` the client sends."""
MAX_WORLD_SIZE = 4096
INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")

Exclusive = Callable[[Callable[[], None]], Awaitable[None]]
"""Runs a function (in a worker thread) while generation is held, so an update lands between batches."""


@dataclass(frozen=True, slots=True)
class Write:
    """Where a received update goes: `apply(pairs)` puts every checked `(name, tensor)` in place
    (it runs while generation is held); `parameters` are the served ones (by Hugging Face name),
    whose dtypes and magnitudes the received values must fit (`weight_values`)."""

    apply: Callable[[list[tuple[str, torch.Tensor]]], None]
    parameters: Mapping[str, torch.Tensor]


def offered_backends(device: torch.device) -> list[str]:
    """The collective backends a receiver on `device` can join: gloo always, NCCL on CUDA."""
    cuda = device.type == "cuda" and dist.is_nccl_available()
    return ["gloo", "nccl"] if cuda else ["gloo"]


def into_parameters(parameters: Mapping[str, torch.Tensor]) -> Write:
    """Copy each received tensor into `parameters` (by Hugging Face name). The copies are in-place
    writes that bump each parameter's version counter, so an engine that watches them (the native
    engine drops its prefix cache) sees the change."""

    def apply(pairs: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in pairs:
                parameters[name].copy_(tensor, non_blocking=True)
        for device in {tensor.device for _, tensor in pairs if tensor.device.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()

    return Write(apply, parameters)


def into_load(
    load: Callable[[list[tuple[str, torch.Tensor]]], None],
    parameters: Mapping[str, torch.Tensor] | None = None,
) -> Write:
    """Hand all received `(name, tensor)` pairs to `load` in one call (vLLM reloads a layer once
    all its tensors arrived, so the update is not split)."""
    return Write(load, parameters or {})


def staged(
    group: WeightGroup, plan: UpdatePlan, deadline: float, parameters: Mapping[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Every bucket received into buffers of its own (one update's worth, on the group's device),
    then every tensor checked: finite, within the range of its parameter's dtype and magnitude
    (`weight_values`, against the served `parameters`). ReceiveError 400 names the first that is
    not; nothing has been applied then, and the group stays usable, since every bucket was received
    whatever their values."""
    pairs = [pair for bucket in collective.receive_buckets(group, plan, deadline=deadline) for pair in bucket]
    check_update_values(pairs, parameters)
    return pairs


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinRequest:
    """An /init_weight_transfer_engine's `init_info`, checked."""

    backend: str
    address: str
    port: int
    rank: int
    world_size: int
    timeout: float
    """Seconds the join may take, at most MAX_INIT_TIMEOUT_S."""
    group_id: str
    secret: str

    @property
    def where(self) -> str:
        return f"{self.address}:{self.port}"

    @classmethod
    def parse(cls, info: dict, device: torch.device, offered: Sequence[str]) -> JoinRequest:
        """The checked request; ReceiveError 400 naming the first bad field."""
        missing = [name for name in INIT_FIELDS if name not in info]
        if missing:
            raise ReceiveError(f"init_info lacks {', '.join(missing)}", 400, "init_info")
        backend = info.get("backend") or ("nccl" if device.type == "cuda" else "gloo")
        if backend not in offered:
            raise ReceiveError(
                f"backend {backend!r} is not offered by this server on {device}; use one of "
                f"{', '.join(offered)} (nccl needs the trainer and the server on CUDA)",
                400,
                "init_info",
            )
        try:
            address, port = str(info["master_address"]), int(info["master_port"])
            rank, world_size = int(info["rank_offset"]), int(info["world_size"])
            timeout = float(info.get("timeout") or DEFAULT_INIT_TIMEOUT_S)
        except (TypeError, ValueError, OverflowError):
            raise ReceiveError(
                "init_info: master_port, rank_offset and world_size must be integers, timeout a number",
                400,
                "init_info",
            ) from None
        _check_join_numbers(port, rank, world_size, timeout)
        return cls(
            backend=backend,
            address=address,
            port=port,
            rank=rank,
            world_size=world_size,
            timeout=min(timeout, MAX_INIT_TIMEOUT_S),
            group_id=str(info.get("group_id") or ""),
            secret=str(info.get("secret") or ""),
        )

    def join(self, device: torch.device) -> tuple[WeightGroup, str | None]:
        """Join the group as this request's rank (blocking); the group and, with a secret, the
        proof answering the trainer's challenge. Connecting to the store, the rendezvous and the
        challenge share one deadline, `timeout` seconds from the start."""
        deadline = time.monotonic() + self.timeout
        store = collective.connect_store(self.address, self.port, self.timeout)
        group = WeightGroup(
            store,
            backend=self.backend,
            rank=self.rank,
            world_size=self.world_size,
            device=device,
            timeout=self.timeout,
            group_id=self.group_id,
            secret=self.secret,
            deadline=deadline,
        )
        if not self.secret:
            return group, None
        return group, collective.answer_challenge(group, self.secret, deadline=deadline)


def _check_join_numbers(port: int, rank: int, world_size: int, timeout: float) -> None:
    """ReceiveError 400 for a port, rank, world size or timeout out of range."""
    if not 0 < port < 65536:
        raise ReceiveError(f"init_info.master_port {port} is not in 1..65535", 400, "init_info")
    if not 1 <= rank < world_size <= MAX_WORLD_SIZE:
        raise ReceiveError(
            f"rank_offset {rank} must be in 1..world_size-1 ({world_size - 1}), world_size at most "
            f"{MAX_WORLD_SIZE}",
            400,
            "init_info",
        )
    if not 0 < timeout < float("inf"):
        raise ReceiveError(f"init_info.timeout {timeout} must be a positive number", 400, "init_info")


class CollectiveReceiver:
    """This process's rank in the trainer's weight-transfer group, on `device`. Joins run one at a
    time, each in a daemon thread of its own."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.group: WeightGroup | None = None
        self.joining = False
        self.receiving = False
        """An update's broadcast is being received (in a daemon thread of its own)."""

    def offered_backends(self) -> list[str]:
        return offered_backends(self.device)

    async def join(self, info: dict) -> dict:
        """Join the trainer's group (replacing any earlier one); ReceiveError 400 for bad fields,
        409 while another join runs, 504 when the trainer does not complete the rendezvous in time.
        Returns the answer."""
        request = JoinRequest.parse(info, self.device, self.offered_backends())
        if self.joining:
            raise ReceiveError(
                "another /init_weight_transfer_engine is still joining a group; retry once it ends "
                f"(each join gives up after at most {MAX_INIT_TIMEOUT_S:.0f}s)",
                409,
                "init_info",
            )
        self.close()
        self.joining = True  # until the thread is done, even if the wait below gives up first
        future = asyncio.wrap_future(in_daemon_thread(request.join, self.device))
        future.add_done_callback(lambda _: setattr(self, "joining", False))
        try:
            group, proof = await asyncio.wait_for(asyncio.shield(future), request.timeout + 10)
        except (TimeoutError, RuntimeError, ValueError) as error:
            # What the remote end sent stays in the server's log: the answer does not echo it.
            logger.warning("joining the weight-transfer group at %s failed: %s", request.where, error)
            raise ReceiveError(
                f"could not join the weight-transfer group at {request.where} as rank {request.rank} of "
                f"{request.world_size} ({request.backend}) within {request.timeout:.0f}s; is the "
                "trainer joining too?",
                504,
                "init_info",
            ) from None
        self.group = group
        logger.info(
            "joined the %s weight-transfer group at %s as rank %d of %d",
            request.backend,
            request.where,
            request.rank,
            request.world_size,
        )
        answer = {"message": "Weight transfer initialized", "backend": request.backend, "rank": request.rank}
        return answer if proof is None else {**answer, "proof": proof}

    def close(self) -> None:
        """Leave the group, if any."""
        if self.group is not None:
            self.group.close()
            self.group = None

    async def receive(
        self,
        info: dict,
        *,
        shapes: Mapping[str, Sequence[int]],
        write: Write,
        exclusive: Exclusive,
    ) -> dict:
        """Check the update against `shapes` (every parameter's Hugging Face name and shape), receive
        it into buffers of its own in a daemon thread while generation goes on, then put it in
        place with `write.apply` inside `exclusive`: generation is held for the copy alone, never
        for a broadcast the trainer stalls. One update at a time (another meanwhile gets 409).
        Returns the answer's message and counts."""
        group = self._group_for(info)
        update_id = info.get("update_id")
        try:
            if self.receiving:
                raise ReceiveError(
                    "another collective /update_weights is still being received; send one update at a time",
                    409,
                    "update_info",
                )
            plan, timeout = _checked_plan(info, shapes)
        except ReceiveError:
            if update_id is not None:
                collective.answer(group, int(update_id), accepted=False)
            raise
        self.receiving = True
        try:
            pairs = await asyncio.wrap_future(
                in_daemon_thread(_take, group, plan, update_id, time.monotonic() + timeout, write.parameters)
            )
        except TransferCancelled as error:
            raise ReceiveError(f"{error}; nothing received", 409, "update_info") from None
        except (TransferTimeout, RuntimeError) as error:
            group.close()
            if self.group is group:
                self.group = None
            status = 504 if isinstance(error, TransferTimeout) else 502
            raise ReceiveError(
                f"receiving the weights failed: {error}. Nothing was applied; the weight-transfer "
                f"group is closed: init it again and resend the whole update",
                status,
                "update_info",
            ) from None
        finally:
            self.receiving = False
        await exclusive(functools.partial(write.apply, pairs))
        return {
            "message": "Weights updated",
            "num_tensors": len(plan.names),
            "num_buckets": len(plan.buckets),
        }

    def _group_for(self, info: dict) -> WeightGroup:
        """The group an update names; ReceiveError 409 when there is none or another replaced it."""
        group = self.group
        if group is None or group.broken:
            raise ReceiveError(
                "no weight-transfer group: POST /init_weight_transfer_engine with the trainer's "
                "master_address and master_port first (or send the weights over HTTP)",
                409,
                "update_info",
            )
        if str(info.get("group_id") or "") != group.group_id:
            raise ReceiveError(
                f"update_info.group_id {info.get('group_id')!r} is not this server's group "
                f"({group.group_id!r}): another trainer initialised it since; init again",
                409,
                "update_info",
            )
        return group


def _checked_plan(info: dict, shapes: Mapping[str, Sequence[int]]) -> tuple[UpdatePlan, float]:
    """The update's plan, checked against `shapes`, and its timeout in seconds; ReceiveError 400
    naming what is wrong."""
    try:
        plan = UpdatePlan.from_json(info)
        collective.check_plan(plan, shapes)
        given = info.get("timeout")
        timeout = DEFAULT_UPDATE_TIMEOUT_S if given is None else float(given)
        if not timeout > 0:  # 0 is no "use the default": a trainer that sends it is refused
            raise ValueError(f"timeout {given!r} must be a positive number of seconds")
    except (TypeError, ValueError, OverflowError) as error:
        raise ReceiveError(f"update refused, nothing received: {error}", 400, "update_info") from None
    return plan, min(timeout, MAX_UPDATE_TIMEOUT_S)


def _take(
    group: WeightGroup,
    plan: UpdatePlan,
    update_id: object,
    deadline: float,
    parameters: Mapping[str, torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    """Answer the trainer's handshake (when the update has an id), then receive and check every
    bucket (`staged`) by `deadline`."""
    if update_id is not None:
        collective.answer(group, int(update_id), accepted=True)
        collective.await_go(group, int(update_id), deadline=deadline)
    with torch.no_grad():
        return staged(group, plan, deadline, parameters)
