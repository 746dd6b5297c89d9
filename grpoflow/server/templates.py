"""Chat templates sent in requests, rendered in worker processes with limits (`TemplateSandbox`).

A template is code: Jinja's sandbox keeps it from Python's internals but not from looping for
hours (`{% for i in range(99999) %}{% for j in range(99999) %}...`) or building a string of
gigabytes (`{{ 'x' * 10**10 }}`, or doubling one in a loop), and a thread cannot be stopped. So a
server started with --trust-request-chat-template renders a request's own template in a process of
its own (`template_worker.py`), `workers` of them at most, each started on first use and kept:
past `timeout_s` the process is killed (and replaced on the next render), its address space is
capped, text longer than `max_chars` is refused (each breach a 400 naming the limit), and a worker
whose resident memory grew by more than RECYCLE_BYTES during a render is replaced after it.

The renders wait on their workers in threads of the sandbox's own, never in the server's request
threads, and a request that finds every worker busy for `wait_s` is refused (503), so slow
templates hold neither the requests without a template of their own nor an unbounded queue. The
tokenizer's own template is the operator's and renders in the server's process as before.
"""

from __future__ import annotations

import asyncio
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
from grpoflow.server.pools import run_in
from grpoflow.threads import DaemonPool

WORKER = Path(__file__).with_name("template_worker.py")
MEMORY_BYTES = 256 << 20
"""Address space a worker may take beyond what its imports took."""
RECYCLE_BYTES = 32 << 20
"""Resident memory a worker may keep beyond what it held when it started; past it, it is replaced
after its render (Python keeps what a large render allocated)."""
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
START_TIMEOUT_S = 60.0
"""Longest a worker may take to start (import transformers' renderer); not counted in a render's
time limit."""


class TemplateSandbox:
    """Renders request templates in up to `workers` processes, each render within `timeout_s`
    seconds and `max_chars` characters of output; `render_soon` waits at most `wait_s` for a
    free worker."""

    def __init__(self, *, timeout_s: float, max_chars: int, workers: int, wait_s: float = 1.0) -> None:
        self.timeout_s, self.max_chars, self.workers, self.wait_s = timeout_s, max_chars, workers, wait_s
        self.num_started = 0
        """Worker processes started so far (replacements included)."""
        self._idle: queue.SimpleQueue[subprocess.Popen | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(None)  # a slot; its process starts on first use
        self._threads = DaemonPool(workers, "grpoflow-template")
        self._slots: asyncio.Semaphore | None = None  # made in the event loop, on first use

    async def render_soon(self, template: str, messages: list[dict], **kwargs: Any) -> str:
        """`render` in one of the sandbox's threads, awaited from the event loop; a 503 naming
        the limit when no worker comes free within `wait_s`."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        try:
            await asyncio.wait_for(self._slots.acquire(), self.wait_s)
        except TimeoutError:
            raise RequestError(
                f"all {self.workers} chat template workers stayed busy for {self.wait_s:g}s "
                f"(--template-workers, --template-wait-s): retry later",
                503,
                "chat_template",
            ) from None
        try:
            return await run_in(self._threads, self.render, template, messages, **kwargs)
        finally:
            self._slots.release()

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
        if _resident_bytes(worker.pid) > worker.start_bytes + RECYCLE_BYTES:
            worker.kill()
            worker.wait()
            worker = None
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
        self.num_started += 1
        worker.start_bytes = _resident_bytes(worker.pid)
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
            if remaining <= 0 or not _readable(worker.stdout.fileno(), remaining):
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
        self._threads.shutdown()
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()
                worker.wait()


def _resident_bytes(pid: int) -> int:
    """The process's resident memory; 0 where /proc cannot tell (the address cap still holds)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` has something to read within `timeout_s` (poll, not select: a busy server's
    descriptors run past select's 1,024)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(timeout_s * 1000))
