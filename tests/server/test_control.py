"""Batching, pause and resume, sleep, and clients that leave: the server keeps serving."""

from __future__ import annotations

import threading
import time

import httpx
import pytest


def test_a_client_that_leaves_mid_request_leaves_the_server_serving(live):
    body = {"prompt": [[4, 5, 6]] * 4, "n": 8, "max_tokens": 300, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(live.url + "/v1/completions", json=body, timeout=0.3)
    answer = httpx.post(live.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, timeout=60)
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 1


def test_a_queued_request_whose_client_left_is_never_generated(fresh):
    batcher = fresh.service.batcher
    with httpx.Client(base_url=fresh.url, timeout=60) as session:
        assert session.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        with pytest.raises(httpx.TimeoutException):
            session.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=0.3)
        time.sleep(0.6)  # the handler notices the closed connection and withdraws the request
        calls = batcher.num_engine_calls
        session.post("/resume")
        time.sleep(0.1)
        assert batcher.num_engine_calls == calls
        assert session.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_requests_that_wait_out_a_pause_share_one_engine_call(fresh):
    batcher = fresh.service.batcher
    results = {}

    def ask(index: int) -> None:
        body = {"prompt": [[index + 3] * (index + 1)], "n": index + 1, "max_tokens": 2 + index, "seed": index}
        results[index] = httpx.post(fresh.url + "/v1/completions", json=body, timeout=60)

    httpx.post(fresh.url + "/pause", params={"mode": "wait"})
    assert httpx.get(fresh.url + "/is_paused").json() == {"is_paused": True}
    threads = [threading.Thread(target=ask, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30  # every request queued, however slow the machine
    while len(batcher._queue) < len(threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(batcher._queue) == len(threads) and results == {}  # held while paused
    calls = batcher.num_engine_calls
    httpx.post(fresh.url + "/resume")
    for thread in threads:
        thread.join(timeout=60)
    assert batcher.num_engine_calls == calls + 1
    for index, answer in results.items():
        choices = answer.json()["choices"]
        assert len(choices) == index + 1
        assert all(len(choice["text"]) <= 2 + index for choice in choices)


def test_pause_abort_answers_queued_requests_with_abort(fresh):
    answers = []
    httpx.post(fresh.url + "/pause", params={"mode": "keep"})
    thread = threading.Thread(
        target=lambda: answers.append(
            httpx.post(fresh.url + "/v1/completions", json={"prompt": [1, 2], "n": 2}, timeout=60)
        )
    )
    thread.start()
    time.sleep(0.3)
    httpx.post(fresh.url + "/pause", params={"mode": "abort"})
    thread.join(timeout=10)
    assert [choice["finish_reason"] for choice in answers[0].json()["choices"]] == ["abort", "abort"]
    httpx.post(fresh.url + "/resume")


def test_sleep_and_wake_up_keep_the_server_serving(live):
    with httpx.Client(base_url=live.url, timeout=60) as client:
        assert client.post("/sleep", params={"level": 1}).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert client.post("/wake_up").status_code == 200
        assert client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 200
        assert client.post("/reset_prefix_cache").json() == {"success": True}


def test_sleep_hands_the_engines_memory_back_to_the_driver(fresh, monkeypatch):
    # For other processes on the GPU (an engine in a training process leaves it to that process's
    # allocator): on CUDA, /sleep empties the caching allocator once the engine has let go.
    from grpoflow.server import control

    engine, emptied = fresh.service.engine, []
    monkeypatch.setattr(control.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(control.torch.cuda, "empty_cache", lambda: emptied.append(engine.runner.awake))
    with httpx.Client(base_url=fresh.url, timeout=60) as client:
        assert client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 200
        assert engine.runner.awake
        assert client.post("/sleep", params={"level": 1}).status_code == 200
        assert emptied == [False]
        assert client.post("/wake_up").status_code == 200
        assert client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 200
