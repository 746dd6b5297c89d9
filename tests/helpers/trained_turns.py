"""What a collated batch trains of an episode, checked against the turns its program saw."""

from __future__ import annotations

import torch

from grpoflow.rollout.batch import RolloutBatch


def trained_sequences(batch: RolloutBatch, row: int) -> list[tuple[list[int], list[int], list[float]]]:
    """Row `row` as the sequences the model sees: each one's ids from its first prompt token, loss
    mask and sampling log-probs (the row's prompt belongs to its first sequence, mask 0)."""
    prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
    real = batch.completion_mask[row].bool()
    ids = batch.completion_ids[row][real].tolist()
    mask = batch.loss_mask[row][real].tolist()
    logps = batch.sampling_logps[row][real].tolist()
    starts = (
        [] if batch.sequence_starts is None else batch.sequence_starts[row][real].nonzero().flatten().tolist()
    )
    bounds = [0, *starts, len(ids)]
    sequences = []
    for index, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        head = prompt if index == 0 else []
        sequences.append(
            (
                head + ids[start:stop],
                [0] * len(head) + mask[start:stop],
                [0.0] * len(head) + logps[start:stop],
            )
        )
    return sequences


def assert_every_turn_trained(batch: RolloutBatch, row: int, turns: list[dict]) -> None:
    """Each turn (`prompt_ids`, `completion_ids`, `logprobs` as the server answered the program)
    is in one of the row's sequences, exactly: its prompt, then its sampled ids with loss mask 1
    and their sampling log-probs; and nothing else of the row has a loss."""
    sequences = trained_sequences(batch, row)
    for number, turn in enumerate(turns):
        prompt, sampled = turn["prompt_ids"], turn["completion_ids"]
        span = slice(len(prompt), len(prompt) + len(sampled))
        found = [
            (mask[span], logps[span])
            for ids, mask, logps in sequences
            if ids[: span.stop] == prompt + sampled
        ]
        assert found, f"turn {number}'s prompt and sampled ids are in no trained sequence"
        assert any(
            mask == [1] * len(sampled)
            and torch.allclose(torch.tensor(logps), torch.tensor(turn["logprobs"], dtype=torch.float32))
            for mask, logps in found
        ), f"turn {number}'s sampled ids are trained with another mask or other log-probs: {found}"
    assert sum(sum(mask) for _, mask, _ in sequences) == sum(len(turn["completion_ids"]) for turn in turns)
