"""The checkpoint transport's receiving side: reading safetensors and checking them against a model."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save, save_file

from grpoflow.transport import ReceiveError
from grpoflow.transport.checkpoint_receiver import check_weights, read_bytes, read_path
from grpoflow.transport.checkpoint_sender import write_checkpoint

SHAPES = {"a.weight": torch.Size([2, 3]), "b.weight": torch.Size([4])}
WEIGHTS = {"a.weight": torch.ones(2, 3), "b.weight": torch.arange(4.0)}


def test_a_written_checkpoint_a_file_and_a_body_read_back(tmp_path):
    directory = write_checkpoint(WEIGHTS.items(), tmp_path, version=1, bucket_bytes=16)
    assert len(list(directory.iterdir())) == 2
    save_file(WEIGHTS, str(tmp_path / "one.safetensors"))
    for tensors in (
        read_path(str(directory)),
        read_path(str(tmp_path / "one.safetensors")),
        read_bytes(save(WEIGHTS)),
    ):
        assert sorted(tensors) == sorted(WEIGHTS)
        assert all(torch.equal(tensors[name], tensor) for name, tensor in WEIGHTS.items())


def test_unreadable_weights_are_refused_alike_with_a_400(tmp_path):
    """Missing, garbage and non-regular paths get one answer: errors do not reveal what exists."""
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    answers = []
    for path in (tmp_path / "absent", tmp_path / "bad.safetensors", fifo, tmp_path):
        with pytest.raises(ReceiveError, match="no readable safetensors checkpoint there") as refused:
            read_path(str(path))  # a FIFO is not opened: this would block
        assert refused.value.status == 400
        answers.append(refused.value.message.replace(str(path), "PATH"))
    assert len(set(answers)) == 1
    with pytest.raises(ReceiveError, match="the body is not a safetensors file"):
        read_bytes(b"not safetensors")


def test_nonfinite_and_overflowing_weights_are_refused():
    name = next(iter(WEIGHTS))
    for bad in (float("nan"), float("inf")):
        broken = {**WEIGHTS, name: torch.full_like(WEIGHTS[name], bad)}
        with pytest.raises(ReceiveError, match=f"{name} holds NaN or infinite values"):
            check_weights(broken, SHAPES)
    huge = {**WEIGHTS, name: torch.full_like(WEIGHTS[name], 1e39, dtype=torch.float64)}
    served = {name: torch.ones(shape, dtype=torch.bfloat16) for name, shape in SHAPES.items()}
    with pytest.raises(ReceiveError, match="beyond the largest torch.bfloat16 value"):
        check_weights(huge, SHAPES, served)
    check_weights(WEIGHTS, SHAPES, served)


def test_every_name_shape_and_dtype_is_checked():
    check_weights(WEIGHTS, SHAPES)
    with pytest.raises(ReceiveError, match="holds no tensors"):
        check_weights({}, SHAPES)
    with pytest.raises(
        ReceiveError, match=r"no parameter named 'nope'; use Hugging Face parameter names such as 'a.weight'"
    ):
        check_weights({**WEIGHTS, "nope": torch.zeros(1)}, SHAPES)
    with pytest.raises(ReceiveError, match=r"b.weight has shape \(3,\), the model's has \(4,\)"):
        check_weights({**WEIGHTS, "b.weight": torch.zeros(3)}, SHAPES)
    with pytest.raises(ReceiveError, match="b.weight has dtype torch.int64: weights must be floating point"):
        check_weights({**WEIGHTS, "b.weight": torch.arange(4)}, SHAPES)
