"""Bucket planning, and the gloo group between two ranks of one process (a thread each)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from grpoflow.transport import collective
from grpoflow.transport.collective import (
    TransferCancelled,
    TransferTimeout,
    UpdatePlan,
    WeightGroup,
    plan_update,
)


def weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(4, 8, generator=generator)),  # 128 bytes each in float32
        ("b", torch.randn(8, 4, generator=generator).bfloat16()),  # 64 bytes
        ("c", torch.randn(32, generator=generator)),
        ("d", torch.randn(2, 2, 8, generator=generator)),
        ("e", torch.randn(3, generator=generator).bfloat16()),
    ]


def test_buckets_are_grouped_by_dtype_and_bounded():
    plan, tensors = plan_update(weights(), bucket_bytes=256)
    assert plan.names == ["a", "c", "d", "b", "e"]
    assert plan.dtype_names == ["float32"] * 3 + ["bfloat16"] * 2
    assert plan.buckets == [2, 1, 2]  # a+c fill 256 bytes, d alone, then the bfloat16 pair
    assert [tuple(t.shape) for t in tensors] == [tuple(s) for s in plan.shapes]
    assert UpdatePlan.from_json(plan.to_json()) == plan
    one, _ = plan_update(weights(), bucket_bytes=60)  # a tensor over the bound goes alone
    assert one.buckets == [1, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"names": []}, "names must be a non-empty list"),
        ({"dtype_names": ["float32"]}, "one dtype per name"),
        ({"shapes": [[4, 8], [32], [2, -2, 8], [8, 4], [3]]}, "d has shape"),
        ({"dtype_names": ["float32", "float32", "int64", "bfloat16", "bfloat16"]}, "not a float dtype"),
        ({"buckets": [2, 2]}, "count 4 tensors"),
        ({"buckets": [4, 1]}, "bucket 1 mixes dtypes"),
    ],
)
def test_a_bad_plan_is_refused_naming_the_field(change, message):
    plan, _ = plan_update(weights(), bucket_bytes=256)
    with pytest.raises(ValueError, match=message):
        UpdatePlan.from_json({**plan.to_json(), **change})


def test_check_plan_names_the_unknown_parameter_and_the_wrong_shape():
    plan, _ = plan_update(weights())
    targets = {name: tensor.shape for name, tensor in weights()}
    collective.check_plan(plan, targets)
    with pytest.raises(ValueError, match="no parameter named 'e'"):
        collective.check_plan(plan, {k: v for k, v in targets.items() if k != "e"})
    with pytest.raises(ValueError, match=r"c has shape \(32,\), the model's has \(31,\)"):
        collective.check_plan(plan, {**targets, "c": torch.Size([31])})


def test_check_plan_refuses_a_parameter_sent_twice():
    """An update naming one parameter many times (20,000 copies of the embedding) would be
    received whole, far larger than the model: it is refused before anything is received."""
    repeated = [*weights(), *(("e", tensor) for name, tensor in weights() if name == "e")]
    plan, _ = plan_update(repeated)
    targets = {name: tensor.shape for name, tensor in weights()}
    with pytest.raises(ValueError, match="the update names 'e' more than once"):
        collective.check_plan(plan, targets)


def pair(timeout: float = 20.0, secrets: tuple[str, str] = ("", "")) -> tuple[WeightGroup, WeightGroup]:
    """Rank 0 and rank 1 of one gloo group, built at once (the constructor is the rendezvous);
    each rank may hold a secret of its own. A rank that could not join is its error."""
    store = collective.host_store(timeout)
    joined = {}

    def join(rank: int, rank_store) -> None:
        try:
            joined[rank] = WeightGroup(
                rank_store,
                backend="gloo",
                rank=rank,
                world_size=2,
                device=torch.device("cpu"),
                timeout=timeout,
                secret=secrets[rank],
            )
        except RuntimeError as error:
            joined[rank] = error

    other = threading.Thread(
        target=join, args=(1, collective.connect_store("127.0.0.1", store.port, timeout))
    )
    other.start()
    join(0, store)
    other.join()
    return joined[0], joined[1]


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) of sockets listening on `port`."""
    addresses = set()
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            local, _, state = line.split()[1:4]
            address, local_port = local.split(":")
            if int(local_port, 16) == port and state == "0A":  # LISTEN
                addresses.add(address)
    return addresses


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_the_trainer_store_listens_on_the_given_address_only():
    store = collective.host_store(5, address="127.0.0.1")
    assert listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0


def test_a_rank_without_the_groups_secret_cannot_join_or_answer_for_one():
    sender, stranger = pair(timeout=2.0, secrets=("s3cret", ""))
    assert isinstance(sender, RuntimeError) and isinstance(stranger, RuntimeError)
    # A process that found the group's keys (list_keys) and took the rank still cannot prove it.
    sender, impostor = pair(secrets=("s3cret", "s3cret"))
    answered = []
    thread = threading.Thread(
        target=lambda: answered.append(
            collective.answer_challenge(impostor, "guess", deadline=time.monotonic() + 20)
        )
    )
    thread.start()
    nonce = collective.challenge(sender, deadline=time.monotonic() + 20)
    thread.join()
    assert answered[0] != collective.proof("s3cret", nonce)
    sender.close(), impostor.close()


def test_the_store_never_holds_the_groups_secret():
    """Any client of the store can list its keys: the group's secret was once their prefix, and
    whoever read it could answer the challenge. Neither a key nor a value holds it now."""
    secret = collective.new_secret()
    sender, receiver = pair(secrets=(secret, secret))
    answered = []
    thread = threading.Thread(
        target=lambda: answered.append(
            collective.answer_challenge(receiver, secret, deadline=time.monotonic() + 20)
        )
    )
    thread.start()
    nonce = collective.challenge(sender, deadline=time.monotonic() + 20)
    thread.join()
    assert answered == [collective.proof(secret, nonce)]
    collective.answer(receiver, 1, accepted=True)
    collective.decide(sender, 1, go=True)
    snoop = collective.connect_store("127.0.0.1", sender.store.underlying_store.port, 5)
    keys = snoop.list_keys()
    assert len(keys) > 3  # the rendezvous and the handshake are there ...
    for key in keys:  # ... but not the secret
        assert secret not in key and secret.encode() not in snoop.get(key), key
    sender.close(), receiver.close()


def test_send_and_receive_unpack_every_tensor_into_its_target():
    sender, receiver = pair()
    plan, tensors = plan_update(weights(), bucket_bytes=256)
    targets = {name: torch.zeros_like(tensor).float() for name, tensor in weights()}  # any dtype
    deadline = time.monotonic() + 20
    thread = threading.Thread(
        target=collective.receive, args=(receiver, plan, targets), kwargs={"deadline": deadline}
    )
    thread.start()
    collective.send(sender, plan, tensors, deadline=deadline)
    thread.join()
    for name, tensor in weights():
        assert torch.equal(targets[name], tensor.float()), name
    sender.close(), receiver.close()


def test_the_handshake_cancels_and_a_missing_broadcast_times_out():
    sender, receiver = pair()
    collective.answer(receiver, 1, accepted=False)
    assert collective.await_ready(sender, 1, deadline=time.monotonic() + 5, poll=lambda: None) == [1]
    collective.decide(sender, 1, go=False)
    with pytest.raises(TransferCancelled, match="cancelled update 1"):
        collective.await_go(receiver, 1, deadline=time.monotonic() + 5)
    with pytest.raises(TransferTimeout, match="did not start update 2"):
        collective.await_go(receiver, 2, deadline=time.monotonic() + 0.3)
    plan, _ = plan_update(weights())
    targets = {name: torch.zeros_like(tensor) for name, tensor in weights()}
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"bucket 1/2 \(float32, a \.\. d\) did not arrive"):
        collective.receive(receiver, plan, targets, deadline=time.monotonic() + 0.5)
    assert time.monotonic() - start < 5 and receiver.broken
    assert all(not tensor.any() for tensor in targets.values())
    sender.close()
