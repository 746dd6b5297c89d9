"""The in-process push's grouping of a weight stream into whole decoder layers (no vLLM needed;
the push itself runs in tests/engines/test_vllm.py)."""

from __future__ import annotations

import torch

from grpoflow.transport.in_process import layer_groups


def test_layer_groups_hold_whole_layers_and_are_taken_from_the_stream_one_at_a_time():
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{part}.weight" for i in range(4) for part in ("q_proj", "k_proj", "mlp")]
    names += ["model.norm.weight", "lm_head.weight"]
    consumed = []

    def stream():
        for name in names:
            consumed.append(name)
            yield name, torch.zeros(2)

    groups = layer_groups(stream(), num_groups=3, num_layers=4)
    first = next(groups)
    assert len(consumed) == 1 + 2 * 3 + 1  # the group, and the tensor that opened the next
    rest = list(groups)
    layers = [
        sorted({name.split(".")[2] for name, _ in group if ".layers." in name}) for group in [first, *rest]
    ]
    assert layers == [["0", "1"], ["2"], ["3"]]
    assert first[0][0] == "model.embed_tokens.weight" and rest[-1][-1][0] == "lm_head.weight"
    assert [name for group in [first, *rest] for name, _ in group] == names
    assert len(list(layer_groups(((n, torch.zeros(1)) for n in names), num_groups=9, num_layers=4))) == 4
    assert len(list(layer_groups(((n, torch.zeros(1)) for n in names), num_groups=1, num_layers=4))) == 1
