import pytest
import torch

from grpoflow.algo import off_policy_mask, overlong_mask, select_groups, zero_std_groups

NAN = float("nan")


def test_zero_std_groups_flags_groups_without_spread():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, NAN, 2.0, 2.0, NAN, NAN, 3.0, NAN, NAN])
    # groups: [1, 1, 0] spread; [1, nan, 2] spread; [2, nan, nan] one valid; [3, nan, nan] one valid
    assert zero_std_groups(rewards, 3).tolist() == [False, False, True, True]
    assert zero_std_groups(torch.tensor([0.5, 0.5, 0.0, 1.0]), 2).tolist() == [True, False]


def test_overlong_mask_zeroes_truncated_rows_and_keeps_dtype():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    masked = overlong_mask(mask, torch.tensor([False, True, False]))
    assert masked.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert masked.dtype == mask.dtype
    with pytest.raises(ValueError, match="truncated"):
        overlong_mask(mask, torch.tensor([True]))


def test_select_groups_on_tensors_and_lists():
    keep = torch.tensor([True, False, True])
    values = torch.arange(12).view(6, 2)
    assert select_groups(values, keep, 2).tolist() == [[0, 1], [2, 3], [8, 9], [10, 11]]
    assert select_groups(list("abcdef"), keep, 2) == ["a", "b", "e", "f"]
    assert select_groups(list("abcdef"), torch.zeros(3, dtype=torch.bool), 2) == []
    with pytest.raises(ValueError, match="3 groups of 2"):
        select_groups(list("abcde"), keep, 2)


def test_dynamic_sampling_pipeline_keeps_only_informative_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    keep = ~zero_std_groups(rewards, 2)
    assert select_groups(rewards, keep, 2).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_off_policy_mask_drops_negative_advantages_that_drifted_too_far():
    logps = torch.zeros(4, 3)
    # mean log(pi_sampler / pi) over each row's tokens: 1.0, 1.0, 0.0, NaN tokens count as 0
    sampling = torch.tensor([[1.0, 1.0, 9.0], [1.0, 1.0, 1.0], [0.5, -0.5, 0.0], [float("nan"), 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    advantages = torch.tensor([1.0, -1.0, -1.0, -1.0])
    kept = off_policy_mask(advantages, logps, sampling, mask, threshold=0.5)
    # row 0 positive: kept; row 1 drifted 1.0 > 0.5: dropped; row 2 drift 0: kept; row 3 drift 1.0
    torch.testing.assert_close(kept, torch.tensor([[1.0], [0.0], [1.0], [0.0]]))
