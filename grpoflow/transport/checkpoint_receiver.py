"""A rollout server's side of the checkpoint transport: weights read from safetensors and checked.

The tensors come from a safetensors file or every *.safetensors file of a directory on the
receiver's disk (`read_path`, what `checkpoint_sender` writes), or from a safetensors file sent as
a request body (`read_bytes`). `check_weights` refuses an update unless every tensor names a
parameter of the model, has its shape and holds values that fit it (`weight_values`), so a bad
update changes nothing. Failures raise ReceiveError (HTTP 400).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from grpoflow.transport import ReceiveError
from grpoflow.transport.checkpoint_sender import READY_METHOD, RELOAD_METHOD, VLLM_RELOAD_METHOD
from grpoflow.transport.weight_values import check_update_values

RELOAD_METHODS = (VLLM_RELOAD_METHOD, RELOAD_METHOD)
"""The /collective_rpc methods that reload a checkpoint: vLLM's own and grpoflow's worker extension's."""
RPC_METHODS = (*RELOAD_METHODS, READY_METHOD)
"""Every /collective_rpc method a receiver answers."""
HTTP_FORM = (
    "POST the tensors as a safetensors file to /update_weights (Content-Type: application/octet-stream), "
    "or name a safetensors file or directory in update_info.weights_path"
)


def read_path(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or of every *.safetensors file in a directory. Only
    regular files are opened (a FIFO or device would block the reader), and every failure gets the
    same answer, so errors do not tell which paths exist on the server."""
    from safetensors.torch import load_file

    location = Path(path)
    refused = ReceiveError(
        f"weights_path {path!r}: no readable safetensors checkpoint there (a .safetensors file, or a "
        f"directory of them, on the server's disk)"
    )
    try:
        files = sorted(location.glob("*.safetensors")) if location.is_dir() else [location]
        if not files or not all(file.is_file() for file in files):
            raise refused
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_file(str(file)))
    except ReceiveError:
        raise
    except Exception:
        raise refused from None
    return tensors


def read_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file given as bytes (a request body)."""
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as error:
        raise ReceiveError(f"the body is not a safetensors file ({error}); {HTTP_FORM}") from None


def check_weights(
    tensors: Mapping[str, torch.Tensor],
    shapes: Mapping[str, Sequence[int]],
    parameters: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Refuse the update unless every tensor names a parameter of the model (`shapes`, by Hugging
    Face name), has its shape, is floating point and finite, and (given the served `parameters`)
    fits the parameter's dtype and magnitude (`weight_values`)."""
    if not tensors:
        raise ReceiveError("the update holds no tensors")
    unknown = [name for name in tensors if name not in shapes]
    if unknown:
        example = next(iter(shapes))
        raise ReceiveError(
            f"the model has no parameter named {', '.join(map(repr, unknown[:5]))}"
            f"{f' (and {len(unknown) - 5} more)' if len(unknown) > 5 else ''}; use Hugging Face "
            f"parameter names such as {example!r}"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise ReceiveError(
                f"{name} has shape {tuple(tensor.shape)}, the model's has {tuple(shapes[name])}"
            )
        if not tensor.is_floating_point():
            raise ReceiveError(f"{name} has dtype {tensor.dtype}: weights must be floating point")
    check_update_values(tensors.items(), parameters or {})
