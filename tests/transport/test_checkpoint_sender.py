"""The checkpoint transport's sending side: shards, the atomic directory, the reload steps.

The servers are stood in for by the `request` callable the sender is given; RemoteEngine drives
real servers with it in tests/engines/test_remote.py and test_remote_vllm.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from grpoflow.transport import ServerError, WeightSyncError
from grpoflow.transport.checkpoint_sender import CheckpointSender, weight_buckets, write_checkpoint

URL = "http://server:1"


def weights() -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.full((256,), float(i))) for i in range(10)]  # 1 KiB each


def test_weight_buckets_are_bounded():
    weights = [(f"w{i}", torch.zeros(256)) for i in range(10)]  # 1 KiB each
    buckets = list(weight_buckets(weights, max_bytes=3 * 1024))
    assert [len(bucket) for bucket in buckets] == [3, 3, 3, 1]
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in weights]


def test_a_checkpoint_is_written_in_shards_and_renamed_into_place(tmp_path):
    final = write_checkpoint(weights(), tmp_path, version=3, bucket_bytes=4 * 1024)
    assert final == tmp_path / "policy-v3" and sorted(p.name for p in tmp_path.iterdir()) == ["policy-v3"]
    shards = sorted(final.iterdir())
    assert [p.name for p in shards] == [f"model-0000{i}.safetensors" for i in (1, 2, 3)]
    written = {name: tensor for shard in shards for name, tensor in load_file(str(shard)).items()}
    assert all(torch.equal(written[name], tensor) for name, tensor in weights())


def test_a_failed_write_names_the_parameter_and_leaves_nothing(tmp_path):
    bad = [*weights()[:2], ("w2", "not a tensor")]
    with pytest.raises(WeightSyncError, match="version 4: writing the checkpoint"):
        write_checkpoint(bad, tmp_path, version=4)
    assert list(tmp_path.iterdir()) == []


def test_each_server_is_paused_reloaded_and_resumed_and_old_checkpoints_go(tmp_path):
    calls = []

    def request(method, url, path, *, timeout=None, **kwargs):
        calls.append((url, path, kwargs.get("json", kwargs.get("params"))))

    sender = CheckpointSender([URL], ["grpoflow_reload_weights"], request, directory=tmp_path, timeout=9)
    try:
        sender.send(weights(), version=1)
        sender.send(weights(), version=2)
    finally:
        sender.close()
    assert [path for _, path, _ in calls[:5]] == [
        "/pause",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/resume",
    ]
    assert calls[0][2] == {"mode": "wait"}
    assert calls[1][2] == {
        "method": "grpoflow_reload_weights",
        "kwargs": {"weights_path": str(tmp_path.resolve() / "policy-v1")},
        "timeout": 9,
    }
    assert calls[8][2] == {"new_version": "2"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v2"]  # the old one removed
    assert tmp_path.exists()  # a directory given to the sender stays


def test_a_failed_step_resumes_the_server_and_names_it(tmp_path):
    calls = []

    def request(method, url, path, *, timeout=None, **kwargs):
        calls.append(path)
        if path == "/collective_rpc":
            raise ServerError(f"vLLM server {url} answered POST {path} with HTTP 500: boom")

    sender = CheckpointSender([URL], ["reload_weights"], request, directory=tmp_path)
    try:
        with pytest.raises(
            WeightSyncError, match=r"version 5 on vLLM server http://server:1 failed at step 'reload_weights'"
        ):
            sender.send(weights(), version=5)
    finally:
        sender.close()
    assert calls == ["/pause", "/collective_rpc", "/resume"]


def test_a_server_without_collective_rpc_is_refused_before_anything_is_written(tmp_path):
    sender = CheckpointSender([URL], [None], lambda *args, **kwargs: None, directory=tmp_path)
    try:
        with pytest.raises(ValueError, match="do not expose /collective_rpc"):
            sender.send(weights(), version=1)
    finally:
        sender.close()
    assert list(tmp_path.iterdir()) == []
