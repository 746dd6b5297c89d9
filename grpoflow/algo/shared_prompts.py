"""Each group's prompt through the model once: its completions packed after it, each attending to
the prompt and to itself.

A GRPO group's completions all follow the same prompt, so a padded (or plainly packed) update runs
the decoder over that prompt once per completion: with 8 samples of a 128-token prompt and 256 new
tokens, a third of the tokens an update computes are prompt tokens, seven eighths of them repeats.
Packed here, a micro-batch is one row holding, per group, the prompt's real tokens once and then
each completion's real tokens, positioned as if it followed the prompt alone. Attention keeps each
part to its own context: the prompt attends to itself (causal); completion j's queries attend to
the prompt's keys and to its own (causal), through a key index that lists, per sequence, the
packed tokens its keys come from (`PackedSequences.key_index`; `policy.varlen_attention` attends
with it). The hidden state of the prompt's last token predicts every completion's first token.

Every projection, norm and feed-forward product then runs once per prompt token instead of once per
completion, and gradients from all the group's completions meet in the prompt's one pass. The
log-probs are those of the padded forward up to the order of floating-point sums.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from grpoflow.algo.packing import PackedSequences, require_prompt_tokens


def prompt_runs(prompt_ids: Tensor, prompt_mask: Tensor) -> list[range]:
    """Runs of consecutive rows with the same prompt (tokens and padding), in order."""
    return _runs(prompt_ids.cpu().numpy(), prompt_mask.bool().cpu().numpy())


def _runs(prompt_ids: np.ndarray, prompt_real: np.ndarray) -> list[range]:
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(axis=1) & (prompt_real[1:] == prompt_real[:-1]).all(axis=1)
    cuts = [0, *(np.flatnonzero(~same) + 1).tolist(), prompt_ids.shape[0]]
    return [range(start, stop) for start, stop in zip(cuts[:-1], cuts[1:])]


def pack_shared_prompts(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor
) -> PackedSequences | None:
    """Pack a padded batch (prompts left-padded, completions right-padded) with each run of rows
    sharing a prompt as that prompt once, then their completions; None when no two consecutive
    rows share one, or no completion has a token (nothing to save: `packing.pack_sequences`
    then). The masks and prompt ids are read on the host once."""
    prompt_real = prompt_mask.bool().cpu().numpy()
    completion_real = completion_mask.bool().cpu().numpy()
    runs = _runs(prompt_ids.cpu().numpy(), prompt_real)
    if len(runs) == prompt_ids.shape[0] or not completion_real.any():
        return None
    require_prompt_tokens(bool(prompt_real.any(axis=1).all()))
    lengths = completion_real.sum(axis=1)
    prompt_width = prompt_ids.shape[1]
    # flat indices into cat([prompt_ids, completion_ids], dim=1).flatten() of the packed tokens
    width = prompt_width + completion_ids.shape[1]
    tokens, positions, scores, queries, keys, key_index = [], [], [], [0], [0], []
    packed = 0
    for run in runs:
        columns = np.flatnonzero(prompt_real[run.start])
        prompt_tokens = run.start * width + columns
        prompt_index = packed + np.arange(len(columns))
        tokens.append(prompt_tokens)
        positions.append(np.arange(len(columns)))
        queries.append(queries[-1] + len(columns))
        keys.append(keys[-1] + len(columns))
        key_index.append(prompt_index)
        packed += len(columns)
        for row in run:
            length = int(lengths[row])
            if length == 0:
                continue
            own = packed + np.arange(length)
            tokens.append(row * width + prompt_width + np.flatnonzero(completion_real[row]))
            positions.append(len(columns) + np.arange(length))
            scores.append(np.concatenate([prompt_index[-1:], own[:-1]]))
            queries.append(queries[-1] + length)
            keys.append(keys[-1] + len(columns) + length)
            key_index.extend([prompt_index, own])
            packed += length
    device = prompt_ids.device

    def on_device(parts: list, dtype: torch.dtype = torch.long) -> Tensor:
        return torch.from_numpy(
            np.concatenate(parts) if isinstance(parts[0], np.ndarray) else np.array(parts)
        ).to(device=device, dtype=dtype)

    flat = torch.cat([prompt_ids, completion_ids], dim=1).flatten()
    scored = completion_mask.bool()
    query_bounds, key_bounds = np.array(queries), np.array(keys)
    return PackedSequences(
        input_ids=flat[on_device(tokens)].unsqueeze(0),
        position_ids=on_device(positions).unsqueeze(0),
        score_index=on_device(scores),
        targets=completion_ids[scored],
        completion_mask=scored,
        cu_seq_lens=on_device(queries, torch.int32),
        max_length=int(np.diff(query_bounds).max()),
        key_index=on_device(key_index),
        cu_seq_lens_k=on_device(keys, torch.int32),
        max_length_k=int(np.diff(key_bounds).max()),
    )
