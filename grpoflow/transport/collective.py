"""Weights broadcast from the trainer to rollout servers over a process group of their own: the
wire layer both sides share (the trainer's side is `collective_sender.py`, a server's
`collective_receiver.py`).

The trainer (rank 0) and each server (ranks 1..N) form a group through a TCPStore that the trainer
hosts, with `ProcessGroupNCCL` (both sides on CUDA) or `ProcessGroupGloo` built directly on that
store: torch.distributed's default group is never created or touched, so a trainer running under
torchrun keeps its own.

An update moves the weights in buckets: tensors of one dtype concatenated into a flat buffer of at
most `bucket_bytes` (a larger tensor alone), one broadcast per bucket, never one per tensor. The
layout (`UpdatePlan`: names, dtypes, shapes, tensors per bucket) travels first as JSON, so a
receiver checks every name and shape before anything arrives and then unpacks each bucket straight
into its parameters.

Before the first bucket, a handshake over the store: each receiver writes `ready` or `refused`
under the update's id, then the trainer writes `send` or `cancel`. A receiver that refuses an
update therefore leaves no other rank blocked in a broadcast that will never complete.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
NONCE_BYTES = 32
"""Size of the challenge a new group's rank 0 broadcasts."""
DEFAULT_BUCKET_BYTES = 512 * 2**20
"""Most bytes of weights in one broadcast."""
POLL_S = 1e-4
"""How often a wait checks its work, its deadline and the caller's `poll` hook."""
STORE_RETRY_S = 0.05
"""How often a receiver tries again to reach a store that refuses connections."""
BROADCAST_GRACE_S = 1.0
"""How long past its deadline the backend lets a broadcast run (the deadline's own check is first)."""
READY, REFUSED, SEND, CANCEL = b"ready", b"refused", b"send", b"cancel"
_ABANDONED: list = []
"""Closed groups with a broadcast still in flight. Destroying such a gloo group blocks until the
broadcast times out, on whichever thread drops the last reference (a server's event loop, say),
so they are kept instead; only failed transfers leave one here."""


class TransferTimeout(TimeoutError):
    """A rendezvous, handshake or broadcast did not finish in time."""


class TransferCancelled(RuntimeError):
    """The trainer cancelled an update (another receiver refused it)."""


def backend_for(trainer_device: torch.device, receiver_devices: Sequence[str]) -> str:
    """NCCL when the trainer and every receiver are on CUDA, else gloo."""
    on_cuda = trainer_device.type == "cuda" and all(d.startswith("cuda") for d in receiver_devices)
    return "nccl" if on_cuda and dist.is_nccl_available() else "gloo"


def transfer_device(backend: str, device: torch.device) -> torch.device:
    """Where the flat buffers live: the CUDA device for NCCL, the CPU for gloo."""
    return device if backend == "nccl" else torch.device("cpu")


# -- the layout -----------------------------------------------------------------------------------


@dataclass(slots=True)
class UpdatePlan:
    """What one update carries, in order: bucket i holds the next `buckets[i]` tensors of `names`,
    all of one dtype, packed back to back in a flat buffer."""

    names: list[str]
    dtype_names: list[str]
    """torch dtype names without the prefix: "bfloat16", "float32", ..."""
    shapes: list[list[int]]
    buckets: list[int]

    def to_json(self) -> dict:
        """The fields of vLLM's NCCL update_info plus `packed` and `buckets`."""
        return {
            "names": self.names,
            "dtype_names": self.dtype_names,
            "shapes": self.shapes,
            "packed": True,
            "buckets": self.buckets,
        }

    @classmethod
    def from_json(cls, info: dict) -> UpdatePlan:
        """Parse and check an update_info; ValueError names the field at fault."""
        names, dtype_names, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ValueError("update_info.names must be a non-empty list of parameter names")
        if not isinstance(dtype_names, list) or len(dtype_names) != len(names):
            raise ValueError(f"update_info.dtype_names must list one dtype per name ({len(names)})")
        if not isinstance(shapes, list) or len(shapes) != len(names):
            raise ValueError(f"update_info.shapes must list one shape per name ({len(names)})")
        for name, shape in zip(names, shapes):
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"update_info.shapes: {name} has shape {shape!r}, not a list of sizes")
        for name, dtype_name in zip(names, dtype_names):
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(f"update_info.dtype_names: {name} has {dtype_name!r}, not a float dtype")
        buckets = info.get("buckets", [len(names)])
        if not isinstance(buckets, list) or not all(isinstance(b, int) and b > 0 for b in buckets):
            raise ValueError("update_info.buckets must be a list of tensor counts > 0")
        if sum(buckets) != len(names):
            raise ValueError(f"update_info.buckets count {sum(buckets)} tensors, names {len(names)}")
        plan = cls(list(names), [str(d) for d in dtype_names], [list(s) for s in shapes], list(buckets))
        for index, members in enumerate(plan.bucket_members()):
            kinds = {plan.dtype_names[i] for i in members}
            if len(kinds) > 1:
                raise ValueError(f"update_info.buckets: bucket {index + 1} mixes dtypes {sorted(kinds)}")
        return plan

    def bucket_members(self) -> Iterator[range]:
        """The indices into `names` of each bucket, in order."""
        start = 0
        for count in self.buckets:
            yield range(start, start + count)
            start += count

    def dtype(self, index: int) -> torch.dtype:
        return getattr(torch, self.dtype_names[index])

    @property
    def num_bytes(self) -> int:
        sizes = (_numel(shape) * self.dtype(i).itemsize for i, shape in enumerate(self.shapes))
        return sum(sizes)


def plan_update(
    weights: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> tuple[UpdatePlan, list[torch.Tensor]]:
    """Group the weights by dtype (first-seen order) and cut each group into buckets of at most
    `bucket_bytes`; returns the plan and the tensors in the plan's order."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in weights:
        if not tensor.is_floating_point():
            raise ValueError(f"{name} has dtype {tensor.dtype}: only floating-point weights are sent")
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor.detach()))
    plan = UpdatePlan([], [], [], [])
    ordered: list[torch.Tensor] = []
    for dtype, members in by_dtype.items():
        size = 0
        for name, tensor in members:
            nbytes = tensor.numel() * tensor.element_size()
            if not plan.buckets or size == 0 or size + nbytes > bucket_bytes or _new_dtype(plan, dtype):
                plan.buckets.append(0)
                size = 0
            plan.buckets[-1] += 1
            size += nbytes
            plan.names.append(name)
            plan.dtype_names.append(str(dtype).removeprefix("torch."))
            plan.shapes.append(list(tensor.shape))
            ordered.append(tensor)
    return plan, ordered


def _new_dtype(plan: UpdatePlan, dtype: torch.dtype) -> bool:
    return plan.dtype_names[-1] != str(dtype).removeprefix("torch.")


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


# -- the group ------------------------------------------------------------------------------------


def host_store(timeout: float, port: int = 0, address: str = "127.0.0.1") -> dist.TCPStore:
    """The trainer's store, listening on `address` only (the interface the servers reach; a
    TCPStore left to itself listens on every one) and `port` (0: a free one, see `store.port`)."""
    listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(128)
        store = dist.TCPStore(
            address,
            listener.getsockname()[1],
            None,
            True,
            datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now and closes it
    return store


def new_secret() -> str:
    """A group's secret: the trainer hands it to each server over HTTP (behind the API key)."""
    return secrets.token_hex(16)


def store_prefix(secret: str) -> str:
    """Where a group's keys live in the store: a name derived from its secret (an HMAC of a fixed
    label under it), never the secret itself, since any client of a TCPStore can list its keys.
    Knowing the prefix neither gives the secret nor answers the group's challenge."""
    return hmac.new(secret.encode(), b"grpoflow-store-prefix", hashlib.sha256).hexdigest()[:32]


def proof(secret: str, nonce: bytes) -> str:
    """What a rank that holds `secret` answers to the trainer's challenge `nonce`."""
    return hmac.new(secret.encode(), nonce, hashlib.sha256).hexdigest()


def challenge(group: WeightGroup, *, deadline: float) -> bytes:
    """Rank 0: broadcast a fresh random nonce over the new group; every server answers its proof
    over HTTP, so a rank that is not the server the trainer talks to is found before any weights
    are sent."""
    nonce = torch.frombuffer(bytearray(secrets.token_bytes(NONCE_BYTES)), dtype=torch.uint8)
    group.broadcast(
        nonce.to(group.device), deadline=deadline, what="the group's challenge", poll=lambda: None
    )
    return nonce.numpy().tobytes()


def answer_challenge(group: WeightGroup, secret: str, *, deadline: float) -> str:
    """Rank > 0: receive the trainer's challenge and return the proof for it."""
    nonce = torch.zeros(NONCE_BYTES, dtype=torch.uint8, device=group.device)
    group.broadcast(nonce, deadline=deadline, what="the group's challenge", poll=lambda: None)
    return proof(secret, nonce.cpu().numpy().tobytes())


def connect_store(address: str, port: int, timeout: float) -> dist.TCPStore:
    """A receiver's connection to the trainer's store, made within `timeout` seconds (the store's
    own client retries past its timeout, so plain connections reach the store first)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((address, port), timeout=max(deadline - time.monotonic(), 0.01)).close()
            break
        except OSError:
            if time.monotonic() + STORE_RETRY_S > deadline:
                raise TransferTimeout(f"the store at {address}:{port} did not answer in time") from None
            time.sleep(STORE_RETRY_S)
    left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.01))
    return dist.TCPStore(address, port, None, False, left)


class WeightGroup:
    """This process's rank in a weight-transfer group (rank 0 sends), built on `store`.

    Constructing it is the rendezvous: it blocks until every rank of `world_size` has joined, or
    raises by `deadline` (time.monotonic; `timeout` seconds from now when not given), the store's
    waits included.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        backend: str,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout: float,
        group_id: str = "",
        secret: str = "",
        deadline: float | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"weight-transfer backend {backend!r}; known: {', '.join(BACKENDS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
        # The group's keys live under a name derived from its secret (not the secret: see
        # `store_prefix`), so no process without it fills a rank's slot by guessing key names.
        keyed = dist.PrefixStore(f"grpoflow/{store_prefix(secret)}/", store) if secret else store
        self.store, self.backend, self.rank, self.world_size = keyed, backend, rank, world_size
        self.device = transfer_device(backend, device)
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"the nccl backend needs a CUDA device, got {device}; use gloo")
        left = (time.monotonic() + timeout if deadline is None else deadline) - time.monotonic()
        if left <= 0:
            raise TransferTimeout("no time was left to join the weight-transfer group")
        before = store.timeout
        store.set_timeout(datetime.timedelta(seconds=left))  # the rendezvous waits on the store
        try:
            self.process_group = _process_group(keyed, backend, rank, world_size, self.device, left)
        finally:
            store.set_timeout(before)
        self.broken = False
        self._in_flight: dist.Work | None = None
        self.group_id = group_id
        """Chosen by the trainer; every update names it, so a server whose group another trainer
        replaced refuses the update instead of waiting on the wrong store."""

    def broadcast(
        self, tensor: torch.Tensor, *, deadline: float, what: str, poll: Callable[[], None]
    ) -> None:
        """Broadcast `tensor` from rank 0 (a receiver's is overwritten) and wait for it; raises
        TransferTimeout past `deadline` (time.monotonic), and whatever `poll` raises, after
        marking the group broken (it cannot be used again)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        left = max(deadline - time.monotonic(), 0.0) + BROADCAST_GRACE_S
        options.timeout = datetime.timedelta(seconds=left)  # not the group's default
        work = self._in_flight = self.process_group.broadcast([tensor], options)
        try:
            while not work.is_completed():
                poll()
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"{what} did not arrive in time")
                time.sleep(POLL_S)
            work.wait()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Abort the group: pending broadcasts fail, the peers' time out."""
        self.broken = True
        with contextlib.suppress(RuntimeError):  # already torn down
            self.process_group.abort()
        if self._in_flight is not None and not self._in_flight.is_completed():
            _ABANDONED.append(self.process_group)


def _process_group(
    store: dist.Store, backend: str, rank: int, world_size: int, device: torch.device, timeout: float
) -> dist.ProcessGroup:
    """The backend's process group over `store`, built within `timeout` seconds."""
    prefix = dist.PrefixStore("grpoflow-weights/", store)
    limit = datetime.timedelta(seconds=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world_size, limit)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = limit
    with _nccl_errors_raise():
        group = dist.ProcessGroupNCCL(prefix, rank, world_size, options)
    group.eager_connect_single_device(device)
    return group


@contextlib.contextmanager
def _nccl_errors_raise() -> Iterator[None]:
    """Build an NCCL group whose timeouts raise instead of killing the process: PyTorch's
    default error handling tears the whole process down, and a server must outlive a stalled
    trainer. The setting is read when the group is built, so other groups keep theirs."""
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    before = os.environ.get(name)
    os.environ[name] = "2"  # CleanUpOnly: abort the communicator, raise, keep the process
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# -- one update -----------------------------------------------------------------------------------


def ready_key(update_id: int, rank: int) -> str:
    return f"grpoflow-update/{update_id}/ready/{rank}"


def go_key(update_id: int) -> str:
    return f"grpoflow-update/{update_id}/go"


def answer(group: WeightGroup, update_id: int, *, accepted: bool) -> None:
    """Receiver: tell the trainer whether it takes part in update `update_id`."""
    group.store.set(ready_key(update_id, group.rank), READY if accepted else REFUSED)


def await_go(group: WeightGroup, update_id: int, *, deadline: float) -> None:
    """Receiver: wait for the trainer's decision; TransferCancelled on `cancel`."""
    remaining = max(deadline - time.monotonic(), 0.001)
    try:
        group.store.wait([go_key(update_id)], datetime.timedelta(seconds=remaining))
    except RuntimeError as error:  # the store's wait raises a plain error on timeout
        raise TransferTimeout(f"the trainer did not start update {update_id} in time ({error})") from None
    if group.store.get(go_key(update_id)) == CANCEL:
        raise TransferCancelled(f"the trainer cancelled update {update_id}: another server refused it")


def await_ready(
    group: WeightGroup, update_id: int, *, deadline: float, poll: Callable[[], None]
) -> list[int]:
    """Trainer: wait until every receiver has answered; returns the ranks that refused."""
    pending = {rank: ready_key(update_id, rank) for rank in range(1, group.world_size)}
    refused = []
    while pending:
        for rank, key in list(pending.items()):
            if group.store.check([key]):
                if group.store.get(key) == REFUSED:
                    refused.append(rank)
                del pending[rank]
        if pending:
            poll()
            if time.monotonic() > deadline:
                raise TransferTimeout(f"rank(s) {sorted(pending)} did not answer update {update_id} in time")
            time.sleep(POLL_S)
    return refused


def decide(group: WeightGroup, update_id: int, *, go: bool) -> None:
    """Trainer: start (`go`) or cancel update `update_id` on every receiver."""
    group.store.set(go_key(update_id), SEND if go else CANCEL)


def send(
    group: WeightGroup,
    plan: UpdatePlan,
    tensors: Sequence[torch.Tensor],
    *,
    deadline: float,
    poll: Callable[[], None] = lambda: None,
) -> None:
    """Rank 0: broadcast the tensors bucket by bucket. A failure names the bucket and its first
    and last parameter; `poll` runs while waiting (raise from it to stop)."""
    for index, members in enumerate(plan.bucket_members()):
        what = _bucket_name(plan, index, members, len(plan.buckets))
        flat = torch.cat([tensors[i].reshape(-1) for i in members]).to(group.device)
        group.broadcast(flat, deadline=deadline, what=what, poll=poll)


def receive(
    group: WeightGroup, plan: UpdatePlan, targets: Mapping[str, torch.Tensor], *, deadline: float
) -> None:
    """Rank > 0: receive every bucket and copy each tensor into `targets[name]` (its dtype and
    device may differ from the sent one). Check the plan with `check_plan` first."""
    for bucket in receive_buckets(group, plan, deadline=deadline):
        for name, tensor in bucket:
            targets[name].data.copy_(tensor, non_blocking=True)
    if group.device.type == "cuda":
        torch.cuda.current_stream(group.device).synchronize()


def receive_buckets(
    group: WeightGroup, plan: UpdatePlan, *, deadline: float
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Rank > 0: receive the buckets one by one, yielding each as `(name, tensor)` views of its
    freshly received buffer, in the sent dtype, on the group's device."""
    for index, members in enumerate(plan.bucket_members()):
        what = _bucket_name(plan, index, members, len(plan.buckets))
        numel = sum(_numel(plan.shapes[i]) for i in members)
        flat = torch.empty(numel, dtype=plan.dtype(members[0]), device=group.device)
        group.broadcast(flat, deadline=deadline, what=what, poll=lambda: None)
        bucket, offset = [], 0
        for i in members:
            size = _numel(plan.shapes[i])
            bucket.append((plan.names[i], flat[offset : offset + size].view(plan.shapes[i])))
            offset += size
        yield bucket


def check_plan(plan: UpdatePlan, shapes: Mapping[str, Sequence[int]]) -> None:
    """ValueError unless every name is in `shapes` (the receiver's parameters) with that shape,
    once: an update is then never larger than the model (in the widest dtype)."""
    seen: set[str] = set()
    repeated = sorted({name for name in plan.names if name in seen or seen.add(name)})
    if repeated:
        more = f" (and {len(repeated) - 5} more)" if len(repeated) > 5 else ""
        raise ValueError(
            f"the update names {', '.join(map(repr, repeated[:5]))}{more} more than once: send each "
            "parameter once"
        )
    unknown = [name for name in plan.names if name not in shapes]
    if unknown:
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ValueError(
            f"the model has no parameter named {', '.join(map(repr, unknown[:5]))}{more}; use "
            f"Hugging Face parameter names such as {next(iter(shapes))!r}"
        )
    for name, shape in zip(plan.names, plan.shapes):
        if list(shapes[name]) != list(shape):
            raise ValueError(f"{name} has shape {tuple(shape)}, the model's has {tuple(shapes[name])}")


def _bucket_name(plan: UpdatePlan, index: int, members: range, count: int) -> str:
    return (
        f"bucket {index + 1}/{count} ({plan.dtype_names[members[0]]}, "
        f"{plan.names[members[0]]} .. {plan.names[members[-1]]})"
    )
