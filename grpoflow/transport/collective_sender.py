"""The trainer's side of the collective weight transfer: one group with every rollout server
(the wire layer is `collective.py`, a server's side `collective_receiver.py`).

`CollectiveSender.send(weights, version)`:
1. the first time (and after a failure), host a TCPStore, POST /init_weight_transfer_engine to
   every server (rank 1..N) and join as rank 0, choosing NCCL when the weights and every server
   are on CUDA, gloo otherwise;
2. POST /update_weights with the plan (names, dtypes, shapes, buckets, version, timeout) to every
   server at once, in worker threads; each server checks it and answers the handshake;
3. broadcast the buckets while the POSTs wait, then collect their answers.

Any failure raises WeightSyncError naming the server, the version and the bucket (or the step of
the protocol) it stopped at; the group is then rebuilt on the next call.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlsplit

import torch

from grpoflow.threads import in_daemon_thread
from grpoflow.transport import Request, WeightSyncError, collective
from grpoflow.transport.collective import DEFAULT_BUCKET_BYTES, TransferTimeout, WeightGroup


class ServerFailed(Exception):
    """A server answered a weight-transfer request with an error."""

    def __init__(self, url: str, error: BaseException) -> None:
        super().__init__(f"{url}: {error}")
        self.url = url


class CollectiveSender:
    """Broadcasts weights to the servers at `urls` (devices as they report them, e.g. "cuda:0")."""

    def __init__(
        self,
        urls: Sequence[str],
        devices: Sequence[str],
        request: Request,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = 600.0,
        init_timeout: float = 120.0,
    ) -> None:
        self.urls, self.devices, self.request = list(urls), list(devices), request
        self.bucket_bytes, self.timeout, self.init_timeout = bucket_bytes, timeout, init_timeout
        self.group: WeightGroup | None = None
        self.update_id = 0
        self._pool = ThreadPoolExecutor(max_workers=len(self.urls))

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast `weights` to every server as policy version `version`; WeightSyncError on failure."""
        plan, tensors = collective.plan_update(list(weights), self.bucket_bytes)
        if not tensors:
            raise ValueError("update_weights got no weights to send")
        if self.group is None or self.group.broken:
            self._connect(tensors[0].device, version)
        group = self.group
        self.update_id += 1
        info = {
            **plan.to_json(),
            "update_id": self.update_id,
            "group_id": group.group_id,
            "weight_version": str(version),
            "timeout": self.timeout,
        }
        deadline = time.monotonic() + self.timeout
        answers = self._post_all("/update_weights", [{"update_info": info}] * len(self.urls), self.timeout)
        poll = _failure_poll(self.urls, answers)
        where = f"weight update to version {version}"
        try:
            refused = collective.await_ready(group, self.update_id, deadline=deadline, poll=poll)
        except (ServerFailed, TransferTimeout) as error:
            collective.decide(group, self.update_id, go=False)
            self._fail(f"{where}: the servers did not accept the update ({error})", answers, error)
        if refused:
            collective.decide(group, self.update_id, go=False)
            names = ", ".join(self.urls[rank - 1] for rank in refused)
            self._fail(f"{where}: server(s) {names} refused it, nothing was sent", answers)
        collective.decide(group, self.update_id, go=True)
        try:
            collective.send(group, plan, tensors, deadline=deadline, poll=poll)
        except (ServerFailed, TransferTimeout, RuntimeError) as error:
            self._fail(f"{where}: the broadcast to {', '.join(self.urls)} stopped: {error}", answers, error)
        errors = _errors(answers, deadline)
        if errors:
            self.group.close()
            self._fail(f"{where}: server(s) failed after the broadcast", answers)

    def _connect(self, device: torch.device, version: int) -> None:
        """Build the group: every server joins through HTTP while this process joins as rank 0."""
        backend = collective.backend_for(device, self.devices)
        address = reaching_address(self.urls[0])
        store = collective.host_store(self.init_timeout, address=address)
        world_size = len(self.urls) + 1
        group_id, secret = uuid.uuid4().hex, collective.new_secret()
        base = {
            "group_id": group_id,
            "secret": secret,
            "backend": backend,
            "master_address": address,
            "master_port": store.port,
            "world_size": world_size,
            "timeout": self.init_timeout,
        }
        bodies = [{"init_info": {**base, "rank_offset": rank}} for rank in range(1, world_size)]
        deadline = time.monotonic() + self.init_timeout  # the rendezvous and the challenge share it
        answers = self._post_all("/init_weight_transfer_engine", bodies, self.init_timeout + 30)
        # A daemon thread: when a server refuses at once, the rendezvous is abandoned, not awaited.
        joining = in_daemon_thread(
            WeightGroup,
            store,
            backend=backend,
            rank=0,
            world_size=world_size,
            device=device,
            timeout=self.init_timeout,
            group_id=group_id,
            secret=secret,
            deadline=deadline,
        )
        poll = _failure_poll(self.urls, answers)
        where = f"weight update to version {version}: setting up the {backend} weight-transfer group"
        while not joining.done():
            try:
                poll()
            except ServerFailed as error:
                self._fail(f"{where} failed", answers, error)
            if time.monotonic() > deadline + 5:
                self._fail(f"{where} timed out after {self.init_timeout:.0f}s", answers)
            time.sleep(collective.POLL_S * 10)
        if joining.exception() is not None:
            self._fail(f"{where} failed: {joining.exception()}", answers)
        self.group = joining.result()
        self._check_members(secret, answers, where, deadline)

    def _check_members(self, secret: str, answers: list[Future], where: str, deadline: float) -> None:
        """Challenge the new group by `deadline`; every server must answer its init with the proof
        for it, or the group is closed before any weights travel."""
        try:
            nonce = collective.challenge(self.group, deadline=deadline)
        except TransferTimeout as error:
            self._fail(f"{where}: the servers did not take the group's challenge", answers, error)
        if _errors(answers, time.monotonic() + 30):
            self.group.close()
            self._fail(f"{where} failed", answers)
        expected = collective.proof(secret, nonce)
        impostors = [url for url, answer in zip(self.urls, answers) if _proof(answer) != expected]
        if impostors:
            self.group.close()
            self._fail(
                f"{where}: the rank of {', '.join(impostors)} in the group did not prove it holds the "
                f"group's secret (another process may have taken it); nothing was sent",
                answers,
            )

    def _post_all(self, path: str, bodies: list[dict], timeout: float) -> list[Future]:
        return [
            self._pool.submit(self.request, "POST", url, path, timeout=timeout, json=body)
            for url, body in zip(self.urls, bodies)
        ]

    def _fail(self, message: str, answers: list[Future], cause: BaseException | None = None) -> None:
        """Raise WeightSyncError with every server's error; the group is rebuilt next time."""
        if self.group is not None and cause is not None:
            self.group.close()
        details = "; ".join(map(str, _errors(answers, time.monotonic() + 5)))
        raise WeightSyncError(f"{message}{f' ({details})' if details else ''}") from cause

    def close(self) -> None:
        """Close the group here and on the servers (best effort)."""
        if self.group is not None:
            self.group.close()
            for answer in self._post_all("/shutdown_weight_transfer_engine", [{}] * len(self.urls), 10):
                with contextlib.suppress(Exception):  # the server is gone: nothing to close there
                    answer.result(timeout=15)
            self.group = None
        self._pool.shutdown(wait=False)


def reaching_address(url: str) -> str:
    """This machine's address on the route to the server at `url` (127.0.0.1 for a local one)."""
    parts = urlsplit(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parts.hostname or "127.0.0.1", parts.port or 80))  # UDP: no packet is sent
        return probe.getsockname()[0]


def _proof(answer: Future) -> object:
    result = answer.result()
    return result.get("proof") if isinstance(result, dict) else None


def _failure_poll(urls: Sequence[str], answers: list[Future]) -> Callable[[], None]:
    """A `poll` hook raising ServerFailed as soon as any server's request has failed."""

    def poll() -> None:
        for url, answer in zip(urls, answers):
            if answer.done() and answer.exception() is not None:
                raise ServerFailed(url, answer.exception())

    return poll


def _errors(answers: list[Future], deadline: float) -> list[BaseException]:
    """Wait for the answers until `deadline`; the errors of those that failed (the messages name
    their server)."""
    errors = []
    for answer in answers:
        try:
            answer.result(timeout=max(deadline - time.monotonic(), 0.0))
        except Exception as error:
            errors.append(error)
    return errors
