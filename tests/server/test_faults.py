"""Requests that once stalled, starved, corrupted or hung the server: each is answered (4xx where
the request is at fault) and the server keeps serving everyone else."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save

from grpoflow.server import ServeConfig
from grpoflow.server.build import exposure_warning

SAFETENSORS = {"content-type": "application/octet-stream"}
ASK = {"prompt": [1, 2, 3], "max_tokens": 2}


def closed_port() -> int:
    """A port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answered_quickly(
    url: str, path: str = "/health", method: str = "GET", within: float = 5.0, **kwargs
) -> httpx.Response:
    start = time.monotonic()
    response = httpx.request(method, url + path, timeout=30, **kwargs)
    assert time.monotonic() - start < within, f"{method} {path} took {time.monotonic() - start:.1f}s"
    return response


def in_background(function, *args, **kwargs) -> threading.Thread:
    thread = threading.Thread(target=function, args=args, kwargs=kwargs, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def server(serve_live, make_service):
    """A default-configured server of its own (request templates refused, short leases)."""
    live = serve_live(make_service(hold_lease_s=1.0, max_weights_bytes=2**20))
    yield live
    live.stop()


# -- 1. joins that never complete ------------------------------------------------------------


def test_hanging_transfer_inits_starve_nothing(server):
    """Inits with an enormous timeout to a port nobody answers: one join waits (capped), the rest
    are refused at once, and generation, /sleep and /health go on."""
    init = {
        "init_info": {
            "backend": "gloo",
            "master_address": "127.0.0.1",
            "master_port": closed_port(),
            "rank_offset": 1,
            "world_size": 2,
            "timeout": 1e9,
        }
    }
    in_background(httpx.post, server.url + "/init_weight_transfer_engine", json=init, timeout=600)
    time.sleep(0.5)
    for _ in range(5):
        refused = answered_quickly(server.url, "/init_weight_transfer_engine", "POST", json=init)
        assert refused.status_code == 409 and "still joining" in refused.json()["error"]["message"]
    assert answered_quickly(server.url, "/v1/completions", "POST", json=ASK).status_code == 200
    assert answered_quickly(server.url, "/sleep", "POST").status_code == 200
    assert answered_quickly(server.url, "/wake_up", "POST").status_code == 200
    assert answered_quickly(server.url).status_code == 200


def test_init_targets_only_the_asking_client_and_echoes_nothing(server):
    base = {"backend": "gloo", "rank_offset": 1, "world_size": 2, "timeout": 1}
    elsewhere = httpx.post(
        server.url + "/init_weight_transfer_engine",
        json={"init_info": {**base, "master_address": "192.0.2.7", "master_port": 29500}},
    )
    assert elsewhere.status_code == 403 and "--weight-transfer-hosts" in elsewhere.json()["error"]["message"]
    bad_port = httpx.post(
        server.url + "/init_weight_transfer_engine",
        json={"init_info": {**base, "master_address": "127.0.0.1", "master_port": 70000}},
    )
    assert bad_port.status_code == 400 and "master_port" in bad_port.json()["error"]["message"]

    # A listener that answers with a banner: the failed join's answer does not repeat it.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def banner() -> None:
        connection, _ = listener.accept()
        connection.sendall(b"SECRET-BANNER pid 4242\r\n")
        time.sleep(3)
        connection.close()

    in_background(banner)
    port = listener.getsockname()[1]
    failed = httpx.post(
        server.url + "/init_weight_transfer_engine",
        json={"init_info": {**base, "master_address": "127.0.0.1", "master_port": port}},
        timeout=60,
    )
    listener.close()
    assert failed.status_code == 504
    assert "SECRET" not in failed.text and "4242" not in failed.text and str(os.getpid()) not in failed.text


# -- 2. defaults ----------------------------------------------------------------------------------


def test_the_server_listens_on_loopback_by_default_and_warns_when_exposed_without_a_key():
    assert ServeConfig(model="tiny").host == "127.0.0.1"
    assert exposure_warning(ServeConfig(model="tiny")) is None
    assert exposure_warning(ServeConfig(model="tiny", host="0.0.0.0", api_key="k")) is None
    warning = exposure_warning(ServeConfig(model="tiny", host="0.0.0.0"))
    assert "without --api-key" in warning and "replace its weights" in warning


# -- 3. requests that would hold the event loop ----------------------------------------------


def test_request_templates_are_refused_unless_trusted(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' * 20000000 }}"}
    refused = answered_quickly(server.url, "/v1/chat/completions", "POST", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"


def test_a_template_bomb_and_a_huge_prompt_do_not_stall_other_requests(serve_live, make_service):
    live = serve_live(make_service(trust_request_chat_template=True))
    try:
        bomb = "{% for i in range(99999) %}{% for j in range(3000) %}{% endfor %}{% endfor %}x"
        body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": bomb, "max_tokens": 1}
        in_background(lambda: httpx.post(live.url + "/v1/chat/completions", json=body, timeout=600))
        time.sleep(0.5)
        for _ in range(3):
            assert answered_quickly(live.url).status_code == 200
        assert answered_quickly(live.url, "/v1/completions", "POST", json=ASK).status_code == 200
        huge = answered_quickly(live.url, "/v1/completions", "POST", json={"prompt": "x" * 10_000_000})
        assert huge.status_code == 400 and "--max-prompt-chars" in huge.json()["error"]["message"]
    finally:
        live.stop()


def chat_with(live, template: str) -> httpx.Response:
    """The answer to a chat with `template`, within the server's 3 s template timeout and 5 s more
    for a loaded CI machine (unbounded, the templates below would run for hours)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template, "max_tokens": 1}
    return answered_quickly(live.url, "/v1/chat/completions", "POST", within=8.0, json=body)


def test_trusted_request_templates_are_bounded_in_time_output_and_memory(serve_live, make_service):
    # 3 s: the huge template must meet the prompt-size limit first even on a loaded CI machine
    live = serve_live(make_service(trust_request_chat_template=True, template_timeout_s=3.0))
    try:
        loop = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x"
        huge = "{{ 'x' * 20000000 }}"
        doubling = (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
        )
        limits = {
            loop: ["--template-timeout-s"],
            huge: ["--max-prompt-chars"],
            doubling: ["memory", "-timeout-"],
        }
        for template, named in limits.items():
            refused = chat_with(live, template)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "chat_template" and any(n in error["message"] for n in named), error
        fine = chat_with(live, "{% for m in messages %}u:{{ m['content'] }}{% endfor %}a:")
        assert fine.status_code == 200, fine.text
    finally:
        live.stop()


# -- 4. concurrent weight-update starts ------------------------------------------------------


def test_concurrent_starts_open_one_update_and_finish_releases_generation(server):
    long = {"prompt": [[4, 5, 6]] * 4, "n": 4, "max_tokens": 150, "ignore_eos": True}
    in_background(lambda: httpx.post(server.url + "/v1/completions", json=long, timeout=120))
    time.sleep(0.2)
    answers: dict[str, httpx.Response] = {}
    starts = [
        in_background(
            lambda who=who: answers.__setitem__(
                who, httpx.post(server.url + "/start_weight_update", json={"client_id": who}, timeout=60)
            )
        )
        for who in ("a", "b")
    ]
    for thread in starts:
        thread.join(60)
    assert sorted(answer.status_code for answer in answers.values()) == [200, 409]
    assert httpx.post(server.url + "/finish_weight_update", json={}).status_code == 200
    assert answered_quickly(server.url, "/v1/completions", "POST", json=ASK).status_code == 200
    info = httpx.get(server.url + "/server_info").json()["grpoflow"]["weight_transfer"]
    assert info["update_open"] is False


def test_an_abandoned_update_or_pause_expires_with_its_lease(server):
    assert httpx.post(server.url + "/start_weight_update", json={}).status_code == 200
    time.sleep(1.5)  # the lease is 1 s: the trainer that opened it is gone
    assert answered_quickly(server.url, "/v1/completions", "POST", json=ASK).status_code == 200
    assert httpx.post(server.url + "/pause", params={"mode": "keep"}).status_code == 200
    assert httpx.get(server.url + "/is_paused").json() == {"is_paused": True}
    time.sleep(1.5)
    assert httpx.get(server.url + "/is_paused").json() == {"is_paused": False}
    assert answered_quickly(server.url, "/v1/completions", "POST", json=ASK).status_code == 200


# -- 5. weights and bodies ---------------------------------------------------------------------


def test_nonfinite_overflowing_and_oversized_weights_are_refused_atomically(server):
    model = server.service.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    first, second = list(before)[:2]
    for bad in (float("nan"), float("inf")):
        update = {first: before[first] + 1, second: torch.full_like(before[second], bad)}
        refused = httpx.post(server.url + "/update_weights", content=save(update), headers=SAFETENSORS)
        assert refused.status_code == 400 and "NaN or infinite" in refused.json()["error"]["message"]
    assert before[first].dtype == torch.float32
    overflow = {first: torch.full(before[first].shape, 1e300, dtype=torch.float64)}
    refused = httpx.post(server.url + "/update_weights", content=save(overflow), headers=SAFETENSORS)
    assert refused.status_code == 400 and "beyond the largest" in refused.json()["error"]["message"]
    big = httpx.post(server.url + "/update_weights", content=b"\0" * (2**20 + 1), headers=SAFETENSORS)
    assert big.status_code == 413
    for name, tensor in model.named_parameters():
        assert torch.equal(tensor, before[name]), name
    assert answered_quickly(server.url, "/v1/completions", "POST", json=ASK).status_code == 200


def test_a_bad_version_is_refused_before_any_weight_changes(server):
    model = server.service.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    name = next(iter(before))
    assert httpx.post(server.url + "/start_weight_update", json={}).status_code == 200
    changed = httpx.post(
        server.url + "/update_weights", content=save({name: before[name] + 1}), headers=SAFETENSORS
    )
    assert changed.status_code == 200
    refused = httpx.post(server.url + "/finish_weight_update", json={"weight_version": "9" * 5000})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "weight_version"
    assert httpx.post(server.url + "/finish_weight_update", json={"weight_version": 3}).status_code == 200
    assert httpx.get(server.url + "/weight_info").json() == {"weight_version": "3"}


def test_a_fifo_as_weights_path_is_refused_without_blocking(server, tmp_path):
    fifo = tmp_path / "weights.safetensors"
    os.mkfifo(fifo)
    body = {"update_info": {"weights_path": str(fifo)}}
    refused = answered_quickly(server.url, "/update_weights", "POST", json=body)
    assert (
        refused.status_code == 400
        and "no readable safetensors checkpoint" in refused.json()["error"]["message"]
    )


# -- 7. malformed inputs answer 4xx, never 500 ---------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        (b"[" * 100_000 + b"]" * 100_000, None),
        (b'{"prompt": [1, 2], "max_tokens": ' + b"9" * 5000 + b"}", None),
        (json.dumps({"prompt": [1, 2], "stop": ["x"] * 100_000}).encode(), "stop"),
    ],
    ids=["lone-surrogate", "deep-json", "5000-digit-integer", "100k-stop-strings"],
)
def test_malformed_requests_answer_400(server, body, field):
    answer = answered_quickly(
        server.url, "/v1/completions", "POST", content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400, answer.text
    if field is not None:
        assert answer.json()["error"]["param"] == field


def test_a_vanishing_temperature_samples_greedily(server):
    tiny = answered_quickly(server.url, "/v1/completions", "POST", json={**ASK, "temperature": 1e-300})
    greedy = answered_quickly(server.url, "/v1/completions", "POST", json={**ASK, "temperature": 0})
    assert tiny.status_code == 200
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


# -- 10. large bodies ------------------------------------------------------------------------


def post_raw(url: str, path: str, payload: bytes, statuses: list[int]) -> None:
    """POST `payload` over a raw socket (no client-side work to share the GIL with the server's
    threads) and record the answer's status."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        answer = b"".join(iter(lambda: sock.recv(1 << 16), b""))
    statuses.append(int(answer.split()[1]))


def test_large_token_id_bodies_leave_health_answering(server):
    """Bodies of millions of token ids (/v1/completions takes batches of prompts, so large bodies)
    are read, parsed and refused off the event loop, one parse at a time that lets the loop run:
    /health keeps answering at once meanwhile."""
    payload = json.dumps({"prompt": [[5] * 3_000_000], "max_tokens": 1}).encode()
    statuses: list[int] = []
    senders = [in_background(post_raw, server.url, "/v1/completions", payload, statuses) for _ in range(4)]
    worst = 0.0
    with httpx.Client(base_url=server.url, timeout=30) as client:
        while any(sender.is_alive() for sender in senders):
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.01)
    assert statuses == [400] * 4
    assert worst < 0.5, f"/health took {worst:.2f}s"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"prompt": {"prompt_token_ids": [5] * 3_000_000}, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {f"k{i}": i for i in range(800_000)},
            },
        ),
    ],
)
def test_a_body_far_larger_than_one_prompt_is_refused_before_it_is_parsed(server, path, body):
    """Chat and /generate bodies carry one prompt: past its longest plus 8 MiB, a 413 as it streams in."""
    answer = httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=30)
    message = answer.json()["error"]["message"]
    assert answer.status_code == 413 and "--max-prompt-chars or max_model_len" in message, message


# -- 8. clients that go away or never finish sending -------------------------------------------


def post_and_vanish(url: str, path: str, body: dict, running, within_s: float = 60.0) -> None:
    """Send a request over a raw socket and close the connection without reading the answer, once
    `running()` says the server is working on it (at most `within_s` seconds later)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + within_s
        while not running() and time.monotonic() < deadline:
            time.sleep(0.05)


def test_an_abandoned_big_request_stops_and_frees_its_blocks(server):
    engine = server.service.engine
    assert answered_quickly(server.url, "/v1/completions", "POST", json=ASK).status_code == 200
    free_before = engine.runner.pool.num_free
    # Minutes of decoding on the CPU: 8,000 sequences of 500 tokens, 512 at a time.
    big = {"prompt": [[1, 2, 3]] * 8, "n": 1000, "max_tokens": 500, "ignore_eos": True}
    post_and_vanish(
        server.url, "/v1/completions", big, running=lambda: engine.runner.pool.num_free < free_before
    )
    batcher = server.service.batcher
    deadline = time.monotonic() + 30  # stopped within a few decode steps: not minutes
    while (batcher.busy or engine.runner.pool.num_free < free_before) and time.monotonic() < deadline:
        time.sleep(0.05)  # its call ended: a request sent before might join it
    assert engine.runner.pool.num_free == free_before and int(engine.runner.pool.refs.sum()) == 0
    assert not batcher.busy
    small = answered_quickly(server.url, "/v1/completions", "POST", json={**ASK, "max_tokens": 1})
    assert small.status_code == 200
    deadline = time.monotonic() + 30  # a joined request is answered before its call records its stats
    while batcher.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats.num_generated_tokens == 1  # the small request ran alone, after the big one


def closed_by_server(sock: socket.socket, within_s: float = 3.0) -> bool:
    sock.settimeout(10)
    start = time.monotonic()
    return sock.recv(1024) == b"" and time.monotonic() - start < within_s


def test_half_sent_headers_are_cut_off(serve_live, make_service):
    live = serve_live(make_service(header_timeout_s=0.5))
    address = live.url.removeprefix("http://").split(":")
    address = (address[0], int(address[1]))
    try:
        for sent in (b"", b"GET / HTTP/1.1\r\nHost:", b"POST /v1/completions HTTP/1.1\r\n"):
            with socket.create_connection(address) as sock:
                sock.sendall(sent)
                assert closed_by_server(sock), sent
        with socket.create_connection(address) as sock:  # half a request after a whole one
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(10)
            assert sock.recv(1024).startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /health HTTP/1.1\r\nHo")
            assert closed_by_server(sock)
        slow = {"prompt": [1, 2, 3], "n": 32, "max_tokens": 300, "ignore_eos": True}  # over 0.5 s
        assert httpx.post(live.url + "/v1/completions", json=slow, timeout=60).status_code == 200
    finally:
        live.stop()
