"""Weight updates over HTTP: the endpoints of every weight transport (the transports' receiving
sides are in grpoflow.transport; this module maps them to endpoints).

Three ways in, all applied between generation batches (requests that arrive meanwhile wait):

1. Checkpoint reload, as grpoflow's RemoteEngine drives a vLLM server: /pause, then
   POST /collective_rpc {"method": "reload_weights" (or "grpoflow_reload_weights"),
   "kwargs": {"weights_path": DIR}} reads every *.safetensors file in DIR (or the one file named),
   then /reset_prefix_cache, /update_weight_version {"new_version": V}, /resume.
2. vLLM's weight-transfer sequence with an HTTP backend: /init_weight_transfer_engine
   {"init_info": {}}, /start_weight_update (holds generation), any number of /update_weights
   carrying the tensors as a safetensors file in the body (Content-Type: application/octet-stream)
   or {"update_info": {"weights_path": PATH}}, then /finish_weight_update {"weight_version": V}
   (releases generation). An /update_weights outside start/finish holds generation for itself.
   With --engine vllm the tensors of one open update are loaded together at finish, since vLLM
   rebuilds each (fused) layer from one load; an /update_weights outside start/finish must then
   carry whole layers (q, k and v projections together, gate and up together).

3. The same endpoints with a collective backend (gloo, or NCCL between GPUs): init_info with the
   trainer's master_address and master_port, update_info with names/dtype_names/shapes and no
   data; the weights arrive as packed broadcasts (grpoflow.transport.collective_receiver).

Tensors use Hugging Face parameter names; an engine that takes LoRA adapters (the native engine,
vllm with --enable-lora) also takes them as tensors named after the layer they adapt
(`grpoflow.transport.adapters`; checked against the layer, the engine's --max-lora-rank and the
layers it adapts), so after the base a sync moves only the adapters. Every call checks all names
and shapes before it writes any tensor, so a bad update changes nothing. The transports'
ReceiveError becomes the error answer with its status (app.py).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import torch
from fastapi import APIRouter
from starlette.requests import Request

from grpoflow.server.errors import RequestError
from grpoflow.server.pools import run_in
from grpoflow.server.service import Service, check_version, client_of, read_body, read_json, service_of
from grpoflow.transport.checkpoint_receiver import (
    HTTP_FORM,
    RELOAD_METHODS,
    RPC_METHODS,
    check_weights,
    read_bytes,
    read_path,
)
from grpoflow.transport.checkpoint_sender import READY_METHOD

router = APIRouter()

SAFETENSORS_TYPES = ("application/octet-stream", "application/x-safetensors", "application/safetensors")


# -- applying ---------------------------------------------------------------------------------


async def apply(service: Service, tensors: dict[str, torch.Tensor]) -> int:
    """Check (in a request thread: names, shapes, finite values that fit the parameters' dtypes and
    magnitudes), then hand the tensors to the engine between batches (native and hf copy them into the model
    they generate from, vllm loads them into its own); returns how many. Within an open update
    (/start_weight_update) an engine with its own weights gets them all at once, at
    /finish_weight_update: vLLM rebuilds each layer from the tensors of one load."""
    shapes = service.update_shapes({name: tensor.shape for name, tensor in tensors.items()})
    await run_in(service.pools.requests, check_weights, tensors, shapes, service.parameters())
    if service.update_open and not service.engine.shares_policy_weights:
        service.pending_weights.update(tensors)
        return len(tensors)
    await load(service, tensors)
    return len(tensors)


async def load(service: Service, tensors: dict[str, torch.Tensor]) -> None:
    engine = service.engine
    await service.batcher.exclusive(engine.update_weights, list(tensors.items()), engine.policy_version)


async def receive_collective(service: Service, info: dict) -> dict:
    """Receive a collective update between generation batches, then record its version."""
    names, given = info.get("names"), info.get("shapes")
    if isinstance(names, list) and isinstance(given, list) and len(names) == len(given):
        shapes = service.update_shapes(dict(zip(map(str, names), given)))
    else:  # malformed: the receiver refuses it with the reason
        shapes = service.parameter_shapes()
    answer = await service.receiver.receive(
        info,
        shapes=shapes,
        write=service.weight_writer(),
        exclusive=service.batcher.exclusive,
    )
    version = info.get("weight_version")
    if version is not None:
        service.set_version(version)
    service.holds.renew_update()
    return {**answer, "weight_version": service.weight_version}


async def check_transfer_target(request: Request, address: str) -> None:
    """Refuse (403) a group whose master_address is neither the requesting client's own address
    nor in --weight-transfer-hosts: the server connects out only to the trainer that asks it to."""
    allowed = request.app.state.service.config.weight_transfer_hosts
    if "*" in allowed or address in allowed:
        return
    peer = request.client.host if request.client else None
    resolved = await run_in(service_of(request).pools.requests, addresses_of, address)
    if peer is not None and (peer in resolved or (_loopback(peer) and any(map(_loopback, resolved)))):
        return
    raise RequestError(
        f"init_info.master_address {address!r} is not this client's address ({peer}): the server joins "
        f"only the trainer that asks it to; start the server with --weight-transfer-hosts {address} "
        f"(or '*') if the trainer's group listens on another address",
        403,
        "init_info",
    )


def addresses_of(host: str) -> set[str]:
    """The IP addresses `host` resolves to (none when it does not resolve)."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return set()


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


# -- vLLM's weight-transfer endpoints, HTTP backend ---------------------------------------------


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> dict:
    service = service_of(request)
    body = await read_json(request, required=False)
    info = body.get("init_info") or {} if isinstance(body, dict) else None
    if not isinstance(info, dict):
        raise RequestError("init_info must be a JSON object", 400, "init_info")
    if "master_address" in info or info.get("backend") not in (None, "http"):
        await check_transfer_target(request, str(info.get("master_address", "")))
        answer = await service.receiver.join(info)
        service.transfer_backend = answer["backend"]
        return answer
    service.receiver.close()
    service.transfer_backend = "http"
    return {"message": "Weight transfer initialized", "backend": "http"}


@router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(request: Request) -> dict:
    service = service_of(request)
    service.receiver.close()
    service.transfer_backend = None
    return {"message": "Weight transfer shut down"}


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict:
    """Hold generation for an update: 409 while another client's update is open, idempotent (the
    lease renewed) for the client that opened it."""
    service = service_of(request)
    body = await read_json(request, required=False)
    opened = await service.holds.start_update(client_of(request, body))
    message = (
        "Weight update started" if opened else "Weight update already open for this client; lease renewed"
    )
    return {"message": message, "lease_s": service.config.hold_lease_s}


@router.post("/update_weights")
async def update_weights(request: Request) -> dict:
    service = service_of(request)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in SAFETENSORS_TYPES:
        body = await read_body(request, service.max_weights_bytes())
        tensors = await run_in(service.pools.requests, read_bytes, body)
    else:
        body = await read_json(request)
        info = body.get("update_info") if isinstance(body, dict) else None
        if not isinstance(info, dict):
            raise RequestError(f"update_info is missing; {HTTP_FORM}", 400, "update_info")
        if not info.get("weights_path"):
            if "names" in info:
                return await receive_collective(service, info)
            raise RequestError(f"update_info carries no weights: {HTTP_FORM}", 400, "update_info")
        tensors = await run_in(service.pools.requests, read_path, str(info["weights_path"]))
    count = await apply(service, tensors)
    service.holds.renew_update()
    return {"message": "Weights updated", "num_tensors": count}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> dict:
    service = service_of(request)
    body = await read_json(request, required=False)
    version = body.get("weight_version") if isinstance(body, dict) else None
    if version is not None:
        check_version(version)
    if service.pending_weights:
        pending = dict(service.pending_weights)
        service.pending_weights.clear()
        await load(service, pending)
    if version is not None:
        service.set_version(version)
    await service.holds.finish_update()
    return {"message": "Weight update finished", "weight_version": service.weight_version}


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> dict:
    service = service_of(request)
    body = await read_json(request)
    version = body.get("new_version") if isinstance(body, dict) else None
    if version is None:
        raise RequestError("send {'new_version': VERSION}", 400, "new_version")
    service.set_version(check_version(version, "new_version"))
    return {"success": True, "new_version": service.weight_version}


@router.get("/weight_info")
async def weight_info(request: Request) -> dict:
    return {"weight_version": service_of(request).weight_version}


# -- /collective_rpc: the checkpoint reload RemoteEngine uses ---------------------------------


@router.post("/collective_rpc")
async def collective_rpc(request: Request) -> dict:
    service = service_of(request)
    body = await read_json(request)
    method = body.get("method") if isinstance(body, dict) else None
    if method == READY_METHOD:
        return {"results": [True]}
    if method in RELOAD_METHODS:
        kwargs: dict[str, Any] = body.get("kwargs") or {}
        if not isinstance(kwargs, dict) or not kwargs.get("weights_path"):
            raise RequestError(
                f"{method} over HTTP takes kwargs {{'weights_path': DIR}} (a safetensors checkpoint "
                f"on the server's disk)",
                400,
                "kwargs",
            )
        await apply(service, await run_in(service.pools.requests, read_path, str(kwargs["weights_path"])))
        return {"results": [None]}
    known = ", ".join(RPC_METHODS)
    raise RequestError(f"unknown collective_rpc method {method!r}; this server knows: {known}", 400, "method")
