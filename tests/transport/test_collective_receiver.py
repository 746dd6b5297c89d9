"""A server's side of the collective weight transfer, driven by hand as a trainer would (gloo):
`CollectiveReceiver` on its own, then behind the endpoints of `grpoflow serve`.

The server runs in a process of its own, as it does in real use: its group and this test's are
two ranks in two processes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from helpers import support

from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model
from grpoflow.run.infer_workers import free_port
from grpoflow.transport import ReceiveError, collective
from grpoflow.transport.collective import WeightGroup
from grpoflow.transport.collective_receiver import CollectiveReceiver, into_load, into_parameters

COMPLETION = {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with support.serve_in_subprocess(tmp_path_factory.mktemp("server")) as served:
        yield served


def join(url: str, *, group_id: str = "g1", timeout: float = 30.0) -> WeightGroup:
    """Rank 0 of a gloo group with the server as rank 1."""
    store = collective.host_store(timeout)
    init_info = {
        "backend": "gloo",
        "master_address": "127.0.0.1",
        "master_port": store.port,
        "rank_offset": 1,
        "world_size": 2,
        "group_id": group_id,
    }
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            httpx.post, url + "/init_weight_transfer_engine", json={"init_info": init_info}, timeout=60
        )
        group = WeightGroup(
            store,
            backend="gloo",
            rank=0,
            world_size=2,
            device=torch.device("cpu"),
            timeout=timeout,
            group_id=group_id,
        )
        assert answer.result().json() == {
            "message": "Weight transfer initialized",
            "backend": "gloo",
            "rank": 1,
        }
    return group


def error(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


async def in_a_thread(function) -> None:
    """`exclusive` as a server without generation to hold gives it."""
    await asyncio.to_thread(function)


def test_a_receiver_joins_and_takes_updates_into_a_load_or_the_parameters():
    store = collective.host_store(30)
    receiver = CollectiveReceiver(torch.device("cpu"))
    init_info = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2}
    cpu = torch.device("cpu")
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(asyncio.run, receiver.join({**init_info, "group_id": "g"}))
        sender = WeightGroup(
            store, backend="gloo", rank=0, world_size=2, device=cpu, timeout=30, group_id="g"
        )
        assert joined.result() == {"message": "Weight transfer initialized", "backend": "gloo", "rank": 1}
    model, updated = served_model(), build_preset_model("tiny", len(build_char_tokenizer()), seed=7)
    shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    plan, tensors = collective.plan_update(list(updated.named_parameters()), bucket_bytes=4096)
    loaded: list = []
    writers = [into_load(loaded.extend), into_parameters(dict(model.named_parameters()))]
    for update_id, write in enumerate(writers, start=1):
        info = {**plan.to_json(), "update_id": update_id, "group_id": "g", "timeout": 30}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                asyncio.run, receiver.receive(info, shapes=shapes, write=write, exclusive=in_a_thread)
            )
            deadline = time.monotonic() + 30
            assert collective.await_ready(sender, update_id, deadline=deadline, poll=lambda: None) == []
            collective.decide(sender, update_id, go=True)
            collective.send(sender, plan, tensors, deadline=deadline)
            assert answer.result() == {
                "message": "Weights updated",
                "num_tensors": len(plan.names),
                "num_buckets": len(plan.buckets),
            }
    want = dict(updated.named_parameters())
    assert [name for name, _ in loaded] == plan.names
    assert all(torch.equal(tensor, want[name]) for name, tensor in loaded)
    assert all(torch.equal(parameter, want[name]) for name, parameter in model.named_parameters())
    stale = {**plan.to_json(), "group_id": "other"}
    with pytest.raises(ReceiveError, match="another trainer initialised it since") as refused:
        asyncio.run(receiver.receive(stale, shapes=shapes, write=writers[0], exclusive=in_a_thread))
    assert refused.value.status == 409 and refused.value.param == "update_info"
    receiver.close()
    assert receiver.group is None
    sender.close()


def test_one_deadline_bounds_the_whole_join():
    """A store that comes up late, then a rank 0 that never joins: connecting and the rendezvous
    once each took the whole timeout (300 s stated, 634 s measured). The join slot is free again
    within the timeout."""
    port, stores = free_port(), []
    late = threading.Timer(1.5, lambda: stores.append(collective.host_store(30, port=port)))
    late.start()
    receiver = CollectiveReceiver(torch.device("cpu"))
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    start = time.monotonic()
    with pytest.raises(ReceiveError, match="within 2s") as failed:
        asyncio.run(receiver.join({**init_info, "timeout": 2, "secret": "s"}))
    took = time.monotonic() - start
    late.join()
    assert failed.value.status == 504 and not receiver.joining
    assert stores and took < 2.8, took


def joined_receiver(store) -> tuple[CollectiveReceiver, WeightGroup]:
    receiver = CollectiveReceiver(torch.device("cpu"))
    init_info = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2}
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(asyncio.run, receiver.join({**init_info, "group_id": "g"}))
        sender = WeightGroup(
            store, backend="gloo", rank=0, world_size=2, device=torch.device("cpu"), timeout=30, group_id="g"
        )
        joined.result()
    return receiver, sender


def send_update(receiver, sender, weights, update_id: int, **receive):
    plan, tensors = collective.plan_update(weights, bucket_bytes=4096)
    info = {**plan.to_json(), "update_id": update_id, "group_id": "g", "timeout": 30}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(asyncio.run, receiver.receive(info, exclusive=in_a_thread, **receive))
        deadline = time.monotonic() + 30
        assert collective.await_ready(sender, update_id, deadline=deadline, poll=lambda: None) == []
        collective.decide(sender, update_id, go=True)
        collective.send(sender, plan, tensors, deadline=deadline)
        return answer.exception() or answer.result()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e300, 1e30])
def test_a_nonfinite_collective_update_is_refused_whole_and_the_group_stays(bad):
    receiver, sender = joined_receiver(collective.host_store(30))
    model = served_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    parameters = dict(model.named_parameters())
    update = [(name, tensor + 1) for name, tensor in before.items()]
    # 1e300 overflows the float32 parameters; 1e30 fits them, but is far beyond their magnitude
    dtype = torch.float64 if bad == 1e300 else torch.float32
    poisoned = [*update[:-1], (update[-1][0], torch.full_like(update[-1][1], bad, dtype=dtype))]
    writers = {
        "parameters": into_parameters(parameters),
        "load": into_load(lambda pairs: None, parameters),
    }
    for update_id, write in enumerate(writers.values(), start=1):
        refused = send_update(receiver, sender, poisoned, update_id, shapes=shapes, write=write)
        assert isinstance(refused, ReceiveError) and refused.status == 400, refused
        assert update[-1][0] in refused.message and ("NaN" in refused.message or "beyond" in refused.message)
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name
    answer = send_update(receiver, sender, update, 3, shapes=shapes, write=writers["parameters"])
    assert answer["message"] == "Weights updated"
    assert all(torch.equal(parameters[name], tensor) for name, tensor in update)
    receiver.close()
    sender.close()


def test_server_info_offers_gloo_on_the_cpu(url):
    info = httpx.get(url + "/server_info").json()["grpoflow"]["weight_transfer"]
    assert info["backends"] == ["http", "gloo"]


@pytest.mark.parametrize(
    ("init_info", "message"),
    [
        ({"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}, "init_info lacks rank_offset"),
        (
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 2},
            "rank_offset 2 must be in 1..world_size-1",
        ),
        (
            {
                "backend": "nccl",
                "master_address": "127.0.0.1",
                "master_port": 1,
                "rank_offset": 1,
                "world_size": 2,
            },
            "backend 'nccl' is not offered by this server on cpu",
        ),
        (
            {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 2},
            "master_port, rank_offset and world_size must be integers",
        ),
    ],
)
def test_init_refuses_bad_fields(url, init_info, message):
    answer = httpx.post(url + "/init_weight_transfer_engine", json={"init_info": init_info}, timeout=30)
    assert answer.status_code == 400 and message in error(answer)


def test_a_trainer_that_never_joins_times_out_and_generation_goes_on(url):
    store = collective.host_store(30)  # a store, but no rank 0 ever joins the group
    init_info = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2}
    start = time.monotonic()
    answer = httpx.post(
        url + "/init_weight_transfer_engine", json={"init_info": {**init_info, "timeout": 2}}, timeout=60
    )
    assert answer.status_code == 504 and "could not join the weight-transfer group" in error(answer)
    assert time.monotonic() - start < 30
    assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=60).status_code == 200


def test_a_stalled_broadcast_times_out_and_generation_goes_on(url):
    group = join(url)
    info = httpx.get(url + "/server_info").json()  # the server answers while a group is open
    assert info["grpoflow"]["weight_transfer"]["backend"] == "gloo"
    embedding = served_model().get_input_embeddings().weight
    update_info = {
        "names": ["model.embed_tokens.weight"],
        "dtype_names": ["float32"],
        "shapes": [list(embedding.shape)],
        "update_id": 1,
        "group_id": "g1",
        "timeout": 1.5,
    }
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            httpx.post, url + "/update_weights", json={"update_info": update_info}, timeout=60
        )
        assert collective.await_ready(group, 1, deadline=time.monotonic() + 30, poll=lambda: None) == []
        collective.decide(group, 1, go=True)  # ... and then never broadcast
        stalled = answer.result()
    assert stalled.status_code == 504
    assert (
        "bucket 1/1 (float32, model.embed_tokens.weight .. model.embed_tokens.weight) did not arrive"
        in error(stalled)
    )
    assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=60).status_code == 200
    again = httpx.post(url + "/update_weights", json={"update_info": update_info}, timeout=60)
    assert again.status_code == 409 and "init_weight_transfer_engine" in error(again)
    group.close()


def test_a_stalled_broadcast_does_not_hold_generation(url):
    """The update is received into buffers of its own while generation goes on; generation is
    held only for the copy into the parameters. A completion once waited out the update's whole
    timeout behind a trainer that started an update and stalled."""
    group = join(url, group_id="stall")
    embedding = served_model().get_input_embeddings().weight.detach()  # the served values: no change
    plan, tensors = collective.plan_update([("model.embed_tokens.weight", embedding)])
    update_info = {**plan.to_json(), "update_id": 1, "group_id": "stall", "timeout": 8}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            httpx.post, url + "/update_weights", json={"update_info": update_info}, timeout=60
        )
        deadline = time.monotonic() + 30
        assert collective.await_ready(group, 1, deadline=deadline, poll=lambda: None) == []
        collective.decide(group, 1, go=True)  # ... and stall before the broadcast
        start = time.monotonic()
        completion = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=60)
        assert completion.status_code == 200 and time.monotonic() - start < 4
        assert not answer.done()
        collective.send(group, plan, tensors, deadline=deadline)
        assert answer.result().json()["message"] == "Weights updated"
    group.close()


def test_an_update_timeout_of_zero_or_less_is_refused_not_replaced(url):
    """`timeout: 0` once became the 600 s default silently."""
    group = join(url, group_id="zero")
    embedding = served_model().get_input_embeddings().weight
    update_info = {
        "names": ["model.embed_tokens.weight"],
        "dtype_names": ["float32"],
        "shapes": [list(embedding.shape)],
        "group_id": "zero",
    }
    for timeout in (0, -1, "nan"):
        answer = httpx.post(
            url + "/update_weights", json={"update_info": {**update_info, "timeout": timeout}}, timeout=10
        )
        assert answer.status_code == 400 and "must be a positive number of seconds" in error(answer), timeout
    group.close()


def test_a_replaced_or_closed_group_refuses_updates(url):
    old, new = join(url, group_id="old"), join(url, group_id="new")
    update_info = {
        "names": ["lm_head.weight"],
        "dtype_names": ["float32"],
        "shapes": [[1]],
        "group_id": "old",
    }
    stale = httpx.post(url + "/update_weights", json={"update_info": update_info}, timeout=60)
    assert stale.status_code == 409 and "another trainer initialised it since" in error(stale)
    assert httpx.post(url + "/shutdown_weight_transfer_engine", timeout=30).status_code == 200
    closed = httpx.post(
        url + "/update_weights", json={"update_info": {**update_info, "group_id": "new"}}, timeout=60
    )
    assert closed.status_code == 409 and "no weight-transfer group" in error(closed)
    old.close(), new.close()


def served_model() -> torch.nn.Module:
    """A local twin of the served `tiny` model (same shapes)."""
    return build_preset_model("tiny", len(build_char_tokenizer()), seed=42)
