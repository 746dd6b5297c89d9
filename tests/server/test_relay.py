"""The engine relay (relay.py) across a real pipe, both ends in this process: a request a worker's
batcher sends is served by the training process's batcher behind its gate, and a request withdrawn
in the worker, or left by a worker whose pipe closed, is withdrawn there and its sequences stop."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import torch
from helpers.native_fixtures import tiny

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.server.relay import EngineRelay, RelayedBatcher, RelayedEngine
from grpoflow.server.settings import ServeConfig

LONG = SamplingParams(n=4, max_tokens=400, ignore_eos=True, seed=7)


def relay() -> tuple[NativeEngine, EngineRelay]:
    engine = NativeEngine(tiny("qwen2"), config=NativeEngineConfig(max_num_seqs=4, num_kv_blocks=256))
    engine.wake_up()
    return engine, EngineRelay(engine, ServeConfig(model="tiny", batch_window_ms=0), torch.device("cpu"))


def withdrawn_soon(relay: EngineRelay, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while relay.batcher._withdrawals == 0 or relay.batcher.busy:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_a_relayed_request_is_served_behind_the_gate_and_a_withdrawn_one_stops_there():
    engine, main = relay()
    here, there = multiprocessing.Pipe()
    main.serve(here, "test")

    async def scenario():
        worker = RelayedBatcher(RelayedEngine(capabilities=engine.capabilities), there)
        worker.start()
        short = worker.submit([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, seed=1))
        await asyncio.sleep(0.2)
        assert not short.done()  # the gate is closed until the rollout opens it
        main.open()
        (group,) = await asyncio.wait_for(short, 10)
        long = worker.submit([[5, 6, 7]], LONG)
        while not main.batcher.busy:
            await asyncio.sleep(0.001)
        long.cancel()
        return group

    try:
        group = asyncio.run(scenario())
        assert [len(c.token_ids) for c in group] == [4] and group[0].logprobs[0] < 0
        assert withdrawn_soon(main)  # the cancel reached the training process's batcher
        assert engine.stats.num_generated_tokens < 4 * 400
    finally:
        main.close()
        main.stop()


def test_the_requests_of_a_worker_whose_pipe_closes_are_withdrawn():
    engine, main = relay()
    here, there = multiprocessing.Pipe()
    main.serve(here, "test")
    main.open()
    try:
        there.send(("submit", 0, [[5, 6, 7]], LONG))
        while not main.batcher.busy:
            time.sleep(0.001)
        there.close()  # the worker ended
        assert withdrawn_soon(main)
        assert engine.stats.num_generated_tokens < 4 * 400
    finally:
        main.close()
        main.stop()
