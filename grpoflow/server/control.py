"""Generation control, as vLLM's development endpoints offer it: pause and resume, sleep and wake
up, and the prefix-cache reset (vLLM's cache; the native and hf engines keep none across calls)."""

from __future__ import annotations

import torch
from fastapi import APIRouter
from starlette.requests import Request

from grpoflow.server.errors import RequestError
from grpoflow.server.service import client_of, service_of

router = APIRouter()

PAUSE_MODES = ("abort", "wait", "keep")


@router.post("/pause")
async def pause(request: Request) -> dict:
    """Stop starting batches; answers once the running batch has finished. mode=abort (vLLM's
    default) answers the queued requests at once with 'abort' completions; wait and keep keep
    them queued until /resume. The pause is a lease (--hold-lease-s): another /pause renews it,
    and past it generation resumes on its own."""
    mode = request.query_params.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", 400, "mode")
    await service_of(request).holds.pause(mode, client_of(request, None))
    return {"status": "paused"}


@router.post("/resume")
async def resume(request: Request) -> dict:
    await service_of(request).holds.resume()
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict:
    return {"is_paused": service_of(request).batcher.paused}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    service = service_of(request)
    if service.engine.capabilities.prefix_cache:
        await service.batcher.exclusive(service.engine.reset_prefix_cache)
    return {"success": True}


def _sleep(engine, level: int) -> None:
    """The engine frees its generation memory, which goes back to the driver for other processes
    on the GPU (an engine in a training process leaves it to that process's allocator)."""
    engine.sleep(level)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@router.post("/sleep")
async def sleep(request: Request) -> dict:
    """Release the engine's generation memory between batches (the next batch takes it back)."""
    service = service_of(request)
    level = request.query_params.get("level", "1")
    if level not in ("1", "2"):
        raise RequestError(f"level must be 1 or 2, got {level!r}", 400, "level")
    await service.batcher.exclusive(_sleep, service.engine, int(level))
    service.sleeping = True
    return {"status": "sleeping", "level": int(level)}


@router.post("/wake_up")
async def wake_up(request: Request) -> dict:
    service = service_of(request)
    await service.batcher.exclusive(service.engine.wake_up)
    service.sleeping = False
    return {"status": "awake"}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    return {"is_sleeping": service_of(request).sleeping}
