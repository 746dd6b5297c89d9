"""An episode of several sequences in one batch row: collated with its sequence starts, scored as
each sequence on its own (padded and packed), and weighed by every loss type as an episode of one
sequence with the same sampled tokens."""

from __future__ import annotations

import pytest
import torch

from grpoflow.algo import BatchTotals, LossSettings, policy_loss
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion
from grpoflow.learn.learner import Learner
from grpoflow.learn.logprobs import batch_logprobs
from grpoflow.learn.objective import AlgorithmConfig
from grpoflow.learn.update import UpdateSettings
from grpoflow.policy.placement import Placement
from grpoflow.policy.tiny import build_tiny_model
from grpoflow.rollout.batch import collate
from grpoflow.rollout.groups import Group
from grpoflow.rollout.segments import split_sequences

VOCAB = 40
PAD = 0
MAX_COMPLETION_LENGTH = 8


def episode(token_ids, mask, logprobs=None) -> Completion:
    logprobs = logprobs or [-0.25 * bit for bit in mask]
    return Completion(list(token_ids), logprobs, "stop", mask=list(mask))


def update_settings(algorithm: AlgorithmConfig, **overrides) -> UpdateSettings:
    """One row per micro-batch, plain SGD steps (no clipping), temperature 1."""
    fixed = {"max_completion_length": MAX_COMPLETION_LENGTH, "max_grad_norm": 0.0, "temperature": 1.0}
    return UpdateSettings(algorithm=algorithm, micro_batch_size=1, **fixed, **overrides)


def two_episodes(segmented: bool = True) -> Group:
    """Episode A: [10] sampled after the prompt [5, 6]; then a second sequence, its prompt [5, 7]
    and [11, 12] sampled. Episode B: [13, 14] sampled. Unsegmented, A is its sampled tokens as
    one sequence."""
    first = episode([10, 5, 7, 11, 12], [1, 0, 0, 1, 1]) if segmented else episode([10, 11, 12], [1, 1, 1])
    return Group(
        item=PromptItem(prompt="p", prompt_ids=[5, 6]),
        completions=[first, episode([13, 14], [1, 1])],
        texts=["", ""],
        sequence_starts=[[1], []] if segmented else None,
    )


def test_collate_marks_where_each_later_sequence_starts():
    batch = collate([two_episodes()], PAD, torch.device("cpu"))
    assert batch.sequence_starts.tolist() == [[False, True, False, False, False], [False] * 5]
    assert batch.loss_mask.tolist() == [[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.rows(1, 2).sequence_starts.tolist() == [[False, False]]
    assert batch.take(torch.tensor([1, 0])).sequence_starts[1].tolist() == [False, True, False, False, False]
    assert collate([two_episodes(segmented=False)], PAD, torch.device("cpu")).sequence_starts is None


def test_a_sequence_start_must_be_an_unsampled_token_of_the_completion():
    group = two_episodes()
    group.sequence_starts = [[3], []]  # token 11 was sampled
    with pytest.raises(ValueError, match="sequence start 3 must be a token of its completion .* mask is 0"):
        collate([group], PAD, torch.device("cpu"))
    group.sequence_starts = [[9], []]
    with pytest.raises(ValueError, match="sequence start 9"):
        collate([group], PAD, torch.device("cpu"))


def test_each_sequence_becomes_a_forward_row_of_its_own():
    split = split_sequences(collate([two_episodes()], PAD, torch.device("cpu")))
    rows = split.batch
    prompts = [row[mask.bool()].tolist() for row, mask in zip(rows.prompt_ids, rows.prompt_mask)]
    completions = [row[mask.bool()].tolist() for row, mask in zip(rows.completion_ids, rows.completion_mask)]
    assert prompts == [[5, 6], [5, 6], [5]] and completions == [[10], [13, 14], [7, 11, 12]]
    values = torch.tensor([[1.0, 0.0, 0.0], [2.0, 3.0, 0.0], [4.0, 5.0, 6.0]])
    # A's start (its second sequence's first prompt token) is never scored: 0
    assert split.place(values).tolist() == [[1.0, 0.0, 4.0, 5.0, 6.0], [2.0, 3.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_segmented_row_scores_each_sequence_as_if_it_were_alone(padding_free):
    model = build_tiny_model(VOCAB, seed=0)
    settings = update_settings(AlgorithmConfig(), padding_free=padding_free)
    batch = collate([two_episodes()], PAD, torch.device("cpu"))
    logps, entropy = batch_logprobs(Placement.local(model), batch, settings, entropy=True)
    alone = [([5, 6], [10]), ([5, 7], [11, 12]), ([5, 6], [13, 14])]
    separate = collate(
        [
            Group(PromptItem(prompt="p", prompt_ids=prompt), [episode(ids, [1] * len(ids))], [""])
            for prompt, ids in alone
        ],
        PAD,
        torch.device("cpu"),
    )
    expected = batch_logprobs(Placement.local(model), separate, settings)[0]
    torch.testing.assert_close(logps[0, [0, 3, 4]], torch.cat([expected[0, :1], expected[1, :2]]))
    torch.testing.assert_close(logps[1, :2], expected[2, :2])
    assert logps[0, 1] == 0 and entropy[0, 1] == 0  # the second sequence's first token: unscored
    logps[batch.loss_mask.bool()].sum().backward()  # the gradient reaches the model
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


SAMPLED_RATIOS = [1.1, 0.9, 1.0, 1.0, 1.1]
"""pi / pi_old of each sampled token, row by row (A's three, then B's two); all inside the clip
range 0.8 .. 1.2."""
EXPECTED = {
    # per token: -A r inside the clip range; A's tokens -1.1, -0.9, -1.0 (A = 1), B's 1.0, 1.1 (A = -1)
    "grpo": ((-1.1 - 0.9 - 1.0) / 3 + (1.0 + 1.1) / 2) / 2,  # token mean per episode, over episodes
    "dapo": (-3.0 + 2.1) / 5,  # over the batch's 5 sampled tokens
    "bnpo": (-3.0 + 2.1) / 5,
    "dr_grpo": (-3.0 + 2.1) / (2 * MAX_COMPLETION_LENGTH),  # 2 episodes, not 3 sequences
    "luspo": (-3.0 + 2.1) / 2,  # token sum per episode, over episodes
}


@pytest.mark.parametrize("loss_type", sorted(EXPECTED))
def test_every_loss_type_weighs_a_two_sequence_episode_as_one_sequence_of_its_tokens(loss_type):
    """The normalisers count episodes (rows) and sampled tokens: hand-computed values, equal to
    the loss of the same sampled tokens laid out as one sequence per episode."""
    losses = []
    for segmented in (True, False):
        batch = collate([two_episodes(segmented)], PAD, torch.device("cpu"))
        mask = batch.loss_mask.bool()
        old = torch.full(batch.completion_ids.shape, -1.0)
        logps = old.clone()
        logps[mask] = old[mask] + torch.tensor(SAMPLED_RATIOS).log()
        totals = BatchTotals(batch.loss_mask.sum(), len(batch), MAX_COMPLETION_LENGTH)
        loss, _ = policy_loss(
            logps, old, torch.tensor([1.0, -1.0]), batch.loss_mask, LossSettings(loss_type), totals
        )
        losses.append(float(loss))
    assert losses[0] == pytest.approx(EXPECTED[loss_type], abs=1e-6)
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_padding_free_updates_a_segmented_batch_as_the_padded_path_does(loss_type):
    updates = []
    for padding_free in (False, True):
        model = build_tiny_model(VOCAB, seed=0)
        settings = update_settings(AlgorithmConfig(loss_type=loss_type), padding_free=padding_free)
        batch = collate([two_episodes()], PAD, torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        Learner(Placement.local(model), optimizer, scheduler, settings).learn(
            batch, torch.tensor([1.0, -1.0])
        )
        updates.append({name: p.detach() - before[name] for name, p in model.named_parameters()})
    for name, delta in updates[0].items():
        assert delta.abs().max() > 0, name
        torch.testing.assert_close(
            updates[1][name], delta, rtol=0, atol=1e-5 * float(delta.abs().max()) + 1e-7
        )
