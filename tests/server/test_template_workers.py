"""Chat templates sent in requests render on workers of their own: slow ones hold neither the
request threads nor a queue without bound, and a worker that kept a large render's memory is
replaced."""

from __future__ import annotations

import os
import threading
import time

import httpx

from grpoflow.server.templates import TemplateSandbox

MESSAGES = [{"role": "user", "content": "hi"}]
SLOW = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x"
"""A template that renders until its time limit."""


def test_slow_request_templates_leave_other_requests_flowing(serve_live, make_service):
    live = serve_live(
        make_service(
            trust_request_chat_template=True,
            template_timeout_s=1.5,
            template_workers=1,
            template_wait_s=0.3,
            request_threads=2,
        )
    )
    statuses: list[httpx.Response] = []
    body = {"messages": MESSAGES, "chat_template": SLOW, "max_tokens": 1}

    def chat() -> None:
        statuses.append(httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60))

    try:
        slow = [threading.Thread(target=chat, daemon=True) for _ in range(4)]
        for thread in slow:
            thread.start()
        time.sleep(0.2)
        with httpx.Client(base_url=live.url, timeout=30) as client:
            for _ in range(3):
                start = time.monotonic()
                answer = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
                assert answer.status_code == 200, answer.text
                assert time.monotonic() - start < 0.5, f"a completion took {time.monotonic() - start:.2f}s"
        for thread in slow:
            thread.join(timeout=30)
    finally:
        live.stop()
    codes = sorted(answer.status_code for answer in statuses)
    assert codes[0] == 400 and codes[-1] == 503 and set(codes) == {400, 503}, codes
    busy = next(answer for answer in statuses if answer.status_code == 503).json()["error"]
    assert "--template-workers" in busy["message"] and busy["param"] == "chat_template"


def test_a_worker_that_kept_a_large_render_s_memory_is_replaced():
    sandbox = TemplateSandbox(timeout_s=30, max_chars=1000, workers=1)
    try:
        light = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        assert sandbox.render(light, MESSAGES) == "hi" and sandbox.render(light, MESSAGES) == "hi"
        assert sandbox.num_started == 1
        assert sandbox.render("{% set s = 'x' * 60000000 %}{{ s|length }}", MESSAGES) == "60000000"
        assert sandbox.render(light, MESSAGES) == "hi"
        assert sandbox.num_started == 2
    finally:
        sandbox.close()


def test_a_worker_renders_when_the_server_holds_over_1024_descriptors():
    """A server with a thousand clients connected: the worker's pipe is past select()'s 1,024."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    sandbox = TemplateSandbox(timeout_s=30, max_chars=1000, workers=1)
    try:
        assert sandbox.render("{% for m in messages %}{{ m['content'] }}{% endfor %}", MESSAGES) == "hi"
    finally:
        sandbox.close()
        for fd in held:
            os.close(fd)


def test_no_template_workers_render_trusted_templates_in_the_request_threads(
    serve_live, make_service, chat_template
):
    live = serve_live(make_service(trust_request_chat_template=True, template_workers=0))
    body = {"messages": MESSAGES, "chat_template": chat_template, "max_tokens": 1, "logprobs": True}
    try:
        assert live.service.templates is None  # no sandbox: no worker process to start
        answer = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] == len("u:hi\na:")
    finally:
        live.stop()
