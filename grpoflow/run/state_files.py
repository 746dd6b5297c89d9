"""A checkpoint's trainer state without pickle: its tensors in the safetensors format, the rest
in JSON.

The state is a tree of dicts, lists and tuples over tensors, numpy arrays, numbers, strings and
None (optimizer and scheduler state, RNG states, the data position, the run's config). JSON keeps
the tree with a reference in place of each tensor; tuples, dicts with keys other than plain
strings (an optimizer's per-parameter state) and numpy arrays are tagged so they load back as
they were. Nothing read back can run code: JSON and safetensors hold data only.

Checkpoints written before this format hold `trainer_state.pt` (a `torch.save` pickle): they load
with `torch.load(weights_only=True)`, which admits tensors, containers and numpy arrays only; a
file holding anything else is refused without being run.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STATE_FILE = "trainer_state.json"
"""The state's tree, with a reference where each tensor was."""
TENSORS_FILE = "trainer_state.tensors"
"""The state's tensors and numpy arrays, by reference, in the safetensors format (not named
`*.safetensors`: tools that load a checkpoint directory's weights by that pattern never read it)."""
LEGACY_STATE_FILE = "trainer_state.pt"
"""The state as earlier checkpoints kept it (a `torch.save` pickle, read without running code)."""

_TENSOR, _ARRAY, _TUPLE, _DICT = "__tensor__", "__ndarray__", "__tuple__", "__dict__"
_LEGACY_GLOBALS = [np.ndarray((0,)).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32))]
"""What an earlier checkpoint's pickle may name besides torch's own: the numpy RNG state's array."""


def save_state(state: dict[str, Any], directory: Path) -> None:
    """Write `state` as `directory/trainer_state.json` and `directory/trainer_state.tensors`."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, "state")
    save_file(tensors, directory / TENSORS_FILE)
    (directory / STATE_FILE).write_text(json.dumps(tree))


def load_state(directory: Path) -> dict[str, Any]:
    """The state `save_state` wrote into `directory`, or an earlier checkpoint's
    `trainer_state.pt` read without running code (ValueError when it holds anything else)."""
    if (directory / STATE_FILE).is_file():
        tensors = load_file(directory / TENSORS_FILE) if (directory / TENSORS_FILE).is_file() else {}
        return _decode(json.loads((directory / STATE_FILE).read_text()), tensors)
    legacy = directory / LEGACY_STATE_FILE
    try:
        with torch.serialization.safe_globals(_LEGACY_GLOBALS):
            return torch.load(legacy, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"{legacy} holds objects other than tensors, numbers, strings and containers, which "
            f"could run code when loaded: it was not loaded ({str(error).splitlines()[0]}). Resume "
            "from a checkpoint this version of grpoflow wrote, or one you trust re-saved by it"
        ) from None


def has_state(directory: Path) -> bool:
    """Whether `directory` holds a trainer state, in either format."""
    return (directory / STATE_FILE).is_file() or (directory / LEGACY_STATE_FILE).is_file()


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = value.detach().cpu().clone().contiguous()  # safetensors refuses shared storage
        return {_TENSOR: key}
    if isinstance(value, np.ndarray):
        key = str(len(tensors))
        tensors[key] = torch.from_numpy(value.astype(np.float64 if value.dtype.kind == "f" else np.int64))
        return {_ARRAY: key, "dtype": value.dtype.str}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("__") for key in value):
            return {key: _encode(item, tensors, f"{where}.{key}") for key, item in value.items()}
        return {
            _DICT: [
                [_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()
            ]
        }
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(item, tensors, f"{where}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(item, tensors, f"{where}[{i}]") for i, item in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(
        f"the trainer state holds a {type(value).__name__} at {where}: a checkpoint keeps tensors, "
        "numpy arrays, numbers, strings, None and lists, tuples and dicts of them"
    )


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        return tensors[value[_TENSOR]]
    if _ARRAY in value:
        return tensors[value[_ARRAY]].numpy().astype(np.dtype(value["dtype"]))
    if _TUPLE in value:
        return tuple(_decode(item, tensors) for item in value[_TUPLE])
    if _DICT in value:
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in value[_DICT]}
    return {key: _decode(item, tensors) for key, item in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(map(_hashable, key)) if isinstance(key, list) else key
