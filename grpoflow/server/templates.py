"""Chat templates sent in requests, rendered in worker processes with limits (`TemplateSandbox`).

A template is code: Jinja's sandbox keeps it from Python's internals but not from looping for
hours (`{% for i in range(99999) %}{% for j in range(99999) %}...`) or building a string of
gigabytes (`{{ 'x' * 10**10 }}`, or doubling one in a loop), and a thread cannot be stopped. So a
server started with --trust-request-chat-template renders a request's own template in a process of
its own (`template_worker.py`), one per request thread at most, each started on first use and kept:
past `timeout_s` the process is killed (and replaced on the next render), its address space is
capped, and text longer than `max_chars` is refused. Each breach is a 400 naming the limit. The
tokenizer's own template is the operator's and renders in the server's process as before.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from grpoflow.server.errors import RequestError

WORKER = Path(__file__).with_name("template_worker.py")
MEMORY_BYTES = 1 << 30
"""Address space a worker may take beyond what its imports took."""
START_TIMEOUT_S = 60.0
"""Longest a worker may take to start (import transformers' renderer); not counted in a render's
time limit."""


class TemplateSandbox:
    """Renders request templates in up to `workers` processes, each render within `timeout_s`
    seconds and `max_chars` characters of output."""

    def __init__(self, *, timeout_s: float, max_chars: int, workers: int) -> None:
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self._idle: queue.SimpleQueue[subprocess.Popen | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(None)  # a slot; its process starts on first use

    def render(self, template: str, messages: list[dict], **kwargs: Any) -> str:
        """`template` rendered with `messages` and `kwargs` (tools, add_generation_prompt, special
        tokens, ...); RequestError 400 (param `chat_template`) when it fails or breaks a limit."""
        request = json.dumps(
            {"chat_template": template, "messages": messages, "max_chars": self.max_chars, **kwargs}
        )
        worker = self._idle.get()
        try:
            if worker is None or worker.poll() is not None:
                worker = self._start()
            answer = self._ask(worker, request)
        except BaseException:
            if worker is not None:
                worker.kill()
                worker.wait()
            self._idle.put(None)
            raise
        self._idle.put(worker)
        if "error" in answer:
            limit = {"output": " (the server's limit on rendered text, --max-prompt-chars)"}
            message = answer["error"] + limit.get(answer.get("limit"), "")
            raise RequestError(f"the chat template failed: {message}", 400, "chat_template")
        return answer["text"]

    def _start(self) -> subprocess.Popen:
        worker = subprocess.Popen(
            [sys.executable, "-I", str(WORKER), str(MEMORY_BYTES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            self._read_answer(worker, START_TIMEOUT_S)
        except RequestError:
            worker.kill()
            worker.wait()
            raise RequestError("the chat template's worker did not start; retry", 503) from None
        return worker

    def _ask(self, worker: subprocess.Popen, request: str) -> dict:
        try:
            worker.stdin.write(request.encode() + b"\n")
            worker.stdin.flush()
        except OSError:  # it died since its last render
            raise RequestError("the chat template's worker failed; retry", 400, "chat_template") from None
        return self._read_answer(worker, self.timeout_s)

    def _read_answer(self, worker: subprocess.Popen, timeout_s: float) -> dict:
        """The worker's next line as JSON; RequestError past `timeout_s` or when it dies."""
        deadline = time.monotonic() + timeout_s
        # JSON escapes a character in at most 12 bytes: anything longer is not a valid answer.
        limit, chunks, size = 12 * self.max_chars + 4096, [], 0
        while not chunks or not chunks[-1].endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([worker.stdout], [], [], remaining)[0]:
                raise RequestError(
                    f"the chat template did not finish within {timeout_s:g}s (--template-timeout-s)",
                    400,
                    "chat_template",
                )
            chunk = os.read(worker.stdout.fileno(), 1 << 20)
            size += len(chunk)
            if not chunk or size > limit:
                raise RequestError(
                    "the chat template's worker failed (it may have run out of memory)", 400, "chat_template"
                )
            chunks.append(chunk)
        return json.loads(b"".join(chunks))

    def close(self) -> None:
        """Stop the idle workers (a busy one is killed when its render ends or times out)."""
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()
                worker.wait()
