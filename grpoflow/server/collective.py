"""The server's side of the collective weight transfer (grpoflow.transport.collective).

/init_weight_transfer_engine with `{"init_info": {"backend": "gloo" | "nccl", "master_address",
"master_port", "rank_offset", "world_size", "timeout", "group_id"}}` joins the trainer's group as rank
`rank_offset` (TRL's and vLLM's field names; a missing backend means NCCL on a CUDA server, gloo on
a CPU one). The join runs in a worker thread and gives up after `timeout` seconds (default 120), so
the event loop keeps serving. A new init replaces the old group; /shutdown_weight_transfer_engine
(vLLM's name) closes it.

/update_weights with `{"update_info": {"names", "dtype_names", "shapes", "packed": true, "buckets",
"update_id", "group_id", "weight_version", "timeout"}}` checks every name and shape against the model before
anything is received (a bad update is refused with a 400 and changes nothing), then, between
generation batches, answers the trainer's handshake and receives the buckets straight into the
parameters (for the vllm engine: into buffers it then loads, as Service.receive_weights says). A stalled broadcast fails after `timeout` seconds (default 600) with a 504: the group
is closed (init again), the model may hold part of the update, and generation goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
import torch.distributed as dist

from grpoflow.server.errors import RequestError
from grpoflow.server.service import Service
from grpoflow.transport import collective
from grpoflow.transport.collective import TransferCancelled, TransferTimeout, UpdatePlan, WeightGroup

logger = logging.getLogger("grpoflow.server")

DEFAULT_INIT_TIMEOUT_S = 120.0
DEFAULT_UPDATE_TIMEOUT_S = 600.0
INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")


def offered_backends(service: Service) -> list[str]:
    """The collective backends this server can join: gloo always, NCCL on a CUDA server."""
    cuda = service.device.type == "cuda" and dist.is_nccl_available()
    return ["gloo", "nccl"] if cuda else ["gloo"]


async def init_group(service: Service, info: dict) -> dict:
    """Join the trainer's group (replacing any earlier one); a 4xx for bad fields, a 504 when the
    trainer does not complete the rendezvous in time."""
    missing = [name for name in INIT_FIELDS if name not in info]
    if missing:
        raise RequestError(f"init_info lacks {', '.join(missing)}", 400, "init_info")
    device = service.device
    backend = info.get("backend") or ("nccl" if device.type == "cuda" else "gloo")
    if backend not in offered_backends(service):
        raise RequestError(
            f"backend {backend!r} is not offered by this server on {device}; use one of "
            f"{', '.join(offered_backends(service))} (nccl needs the trainer and the server on CUDA)",
            400,
            "init_info",
        )
    try:
        address, port = str(info["master_address"]), int(info["master_port"])
        rank, world_size = int(info["rank_offset"]), int(info["world_size"])
        timeout = float(info.get("timeout") or DEFAULT_INIT_TIMEOUT_S)
    except (TypeError, ValueError):
        raise RequestError(
            "init_info: master_port, rank_offset and world_size must be integers, timeout a number",
            400,
            "init_info",
        ) from None
    if not 1 <= rank < world_size:
        raise RequestError(
            f"rank_offset {rank} must be in 1..world_size-1 ({world_size - 1})", 400, "init_info"
        )
    close_group(service)

    def join() -> WeightGroup:
        store = collective.connect_store(address, port, timeout)
        return WeightGroup(
            store,
            backend=backend,
            rank=rank,
            world_size=world_size,
            device=device,
            timeout=timeout,
            group_id=str(info.get("group_id") or ""),
        )

    try:
        group = await asyncio.wait_for(asyncio.to_thread(join), timeout + 10)
    except (TimeoutError, RuntimeError, ValueError) as error:
        raise RequestError(
            f"could not join the weight-transfer group at {address}:{port} as rank {rank} of "
            f"{world_size} ({backend}) within {timeout:.0f}s: {error}; is the trainer joining too?",
            504,
            "init_info",
        ) from None
    service.weight_group, service.transfer_backend = group, backend
    logger.info(
        "joined the %s weight-transfer group at %s:%d as rank %d of %d",
        backend,
        address,
        port,
        rank,
        world_size,
    )
    return {"message": "Weight transfer initialized", "backend": backend, "rank": rank}


def close_group(service: Service) -> None:
    if service.weight_group is not None:
        service.weight_group.close()
        service.weight_group = None


async def receive_update(service: Service, info: dict) -> dict:
    """Check the update against the model, then receive it between generation batches."""
    group = service.weight_group
    update_id = info.get("update_id")
    if group is None or group.broken:
        raise RequestError(
            "no weight-transfer group: POST /init_weight_transfer_engine with the trainer's "
            "master_address and master_port first (or send the weights over HTTP)",
            409,
            "update_info",
        )
    if str(info.get("group_id") or "") != group.group_id:
        raise RequestError(
            f"update_info.group_id {info.get('group_id')!r} is not this server's group "
            f"({group.group_id!r}): another trainer initialised it since; init again",
            409,
            "update_info",
        )
    try:
        plan = UpdatePlan.from_json(info)
        collective.check_plan(plan, service.parameter_shapes())
        timeout = float(info.get("timeout") or DEFAULT_UPDATE_TIMEOUT_S)
    except (TypeError, ValueError) as error:
        if update_id is not None:
            collective.answer(group, int(update_id), accepted=False)
        raise RequestError(f"update refused, nothing received: {error}", 400, "update_info") from None

    def run() -> None:
        deadline = time.monotonic() + timeout
        if update_id is not None:
            collective.answer(group, int(update_id), accepted=True)
            collective.await_go(group, int(update_id), deadline=deadline)
        with torch.no_grad():
            service.receive_weights(group, plan, deadline=deadline)

    try:
        await service.batcher.exclusive(run)
    except TransferCancelled as error:
        raise RequestError(f"{error}; nothing received", 409, "update_info") from None
    except (TransferTimeout, RuntimeError) as error:
        group.close()
        service.weight_group = None
        status = 504 if isinstance(error, TransferTimeout) else 502
        raise RequestError(
            f"receiving the weights failed: {error}. The model may hold part of this update; the "
            f"weight-transfer group is closed: init it again and resend the whole update",
            status,
            "update_info",
        ) from None
    version = info.get("weight_version")
    if version is not None:
        service.set_version(version)
    return {
        "message": "Weights updated",
        "num_tensors": len(plan.names),
        "num_buckets": len(plan.buckets),
        "weight_version": service.weight_version,
    }
