"""The server's side of the collective weight transfer, driven by hand as a trainer would (gloo).

The server runs in a process of its own, as it does in real use: its group and this test's are
two ranks in two processes.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from helpers import support

from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model
from grpoflow.transport import collective
from grpoflow.transport.collective import WeightGroup

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
