"""Weight updates over HTTP: the weight-transfer sequence and the checkpoint reload endpoint
(RemoteEngine driving them: tests/engines/test_remote.py)."""

from __future__ import annotations

import threading
import time

import httpx
import torch
from safetensors.torch import save, save_file

from grpoflow.policy.tiny import build_preset_model

SAFETENSORS = {"content-type": "application/octet-stream"}


def other_weights(service, seed: int) -> dict[str, torch.Tensor]:
    model = build_preset_model("tiny", service.limits.vocab_size, seed=seed)
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


def served_weights(service) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in service.model.named_parameters()}


def assert_served(service, expected: dict[str, torch.Tensor]) -> None:
    served = served_weights(service)
    for name, tensor in expected.items():
        assert torch.equal(served[name], tensor), name


def test_the_weight_transfer_sequence_over_http_holds_generation(fresh, tmp_path):
    service, url = fresh.service, fresh.url
    original, new = served_weights(service), other_weights(service, seed=9)
    names = list(new)
    with httpx.Client(base_url=url, timeout=60) as client:
        nccl = {
            "backend": "nccl",
            "master_address": "127.0.0.1",
            "master_port": 51216,
            "rank_offset": 1,
            "world_size": 2,
        }
        refused = client.post("/init_weight_transfer_engine", json={"init_info": nccl})
        assert refused.status_code == 400 and "use one of gloo" in refused.json()["error"]["message"]
        assert client.post("/init_weight_transfer_engine", json={"init_info": {}}).status_code == 200
        assert client.post("/start_weight_update", json={}).status_code == 200
        again = client.post("/start_weight_update", json={})  # the same client: idempotent
        assert again.status_code == 200 and "lease renewed" in again.json()["message"]
        other = client.post("/start_weight_update", json={"client_id": "another-trainer"})
        assert (
            other.status_code == 409 and "already open for another client" in other.json()["error"]["message"]
        )

        answers = []
        waiting = threading.Thread(
            target=lambda: answers.append(
                httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
            )
        )
        waiting.start()
        time.sleep(0.3)
        assert answers == []  # generation waits for the update

        unknown = client.post("/update_weights", content=save({"nope": torch.zeros(2)}), headers=SAFETENSORS)
        assert (
            unknown.status_code == 400 and "no parameter named 'nope'" in unknown.json()["error"]["message"]
        )
        shape = {names[0]: torch.zeros(3), names[1]: new[names[1]]}
        assert client.post("/update_weights", content=save(shape), headers=SAFETENSORS).status_code == 400
        assert_served(service, original)  # a refused update writes nothing
        metadata = {"names": names, "dtype_names": ["float32"] * len(names), "shapes": [[1]] * len(names)}
        no_group = client.post("/update_weights", json={"update_info": metadata})
        assert (
            no_group.status_code == 409 and "no weight-transfer group" in no_group.json()["error"]["message"]
        )
        garbage = client.post("/update_weights", content=b"not safetensors", headers=SAFETENSORS)
        assert garbage.status_code == 400

        first = {name: new[name] for name in names[:3]}
        rest = {name: new[name] for name in names[3:]}
        sent = client.post("/update_weights", content=save(first), headers=SAFETENSORS)
        assert sent.json() == {"message": "Weights updated", "num_tensors": 3}
        save_file(rest, str(tmp_path / "rest.safetensors"))
        by_path = {"update_info": {"weights_path": str(tmp_path / "rest.safetensors")}}
        assert client.post("/update_weights", json=by_path).status_code == 200
        finished = client.post("/finish_weight_update", json={"weight_version": "7"}).json()
        assert finished["weight_version"] == "7"
        waiting.join(timeout=30)
        assert answers[0].status_code == 200
        assert_served(service, new)
        assert client.get("/weight_info").json() == {"weight_version": "7"}

        (tmp_path / "original").mkdir()
        save_file(original, str(tmp_path / "original" / "model.safetensors"))
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "original")}}
        assert client.post("/collective_rpc", json=reload).json() == {"results": [None]}
        assert_served(service, original)
        missing = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "absent")}}
        assert client.post("/collective_rpc", json=missing).status_code == 400
        assert client.post("/update_weight_version", json={"new_version": "8"}).json()["new_version"] == "8"


def test_a_finite_but_huge_weight_is_refused_naming_the_parameter_and_its_bound(fresh, tmp_path):
    service, url = fresh.service, fresh.url
    original = served_weights(service)
    name = "model.layers.0.self_attn.v_proj.weight"
    huge = {name: torch.full_like(original[name], 1e38)}  # finite in float32
    save_file(huge, str(tmp_path / "huge.safetensors"))
    with httpx.Client(base_url=url, timeout=60) as client:
        by_body = client.post("/update_weights", content=save(huge), headers=SAFETENSORS)
        by_path = {"update_info": {"weights_path": str(tmp_path / "huge.safetensors")}}
        for answer in (by_body, client.post("/update_weights", json=by_path)):
            message = answer.json()["error"]["message"]
            assert answer.status_code == 400 and f"{name} holds 1e+38, beyond its bound 1e+04" in message
        assert_served(service, original)
        grown = {name: 100 * original[name]}  # far beyond a training step, still within the bound
        assert client.post("/update_weights", content=save(grown), headers=SAFETENSORS).status_code == 200
        assert_served(service, grown)
