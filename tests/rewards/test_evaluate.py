import math

import numpy as np
import torch

from grpoflow.rewards.evaluate import RewardCall, evaluate, normalize


def make_call(completions, **columns):
    size = len(completions)
    return RewardCall(["p"] * size, list(completions), [[1]] * size, columns)


def is_nan(value):
    return isinstance(value, float) and math.isnan(value)


def test_normalize_accepts_numbers_none_and_arrays():
    assert normalize([1, 2.5, True], 3).values == [1.0, 2.5, 1.0]
    assert normalize(torch.tensor([0.5, 1.5]), 2).values == [0.5, 1.5]
    assert normalize(np.array([0.25]), 1).values == [0.25]
    outcome = normalize([None, float("nan"), np.float32(2.0)], 3)
    assert is_nan(outcome.values[0]) and is_nan(outcome.values[1]) and outcome.values[2] == 2.0
    assert outcome.errors == []


def test_normalize_flags_wrong_returns():
    not_list = normalize("1.0", 2)
    assert all(map(is_nan, not_list.values))
    assert "returned str '1.0'" in not_list.errors[0][1] and not_list.errors[0][0] is None
    short = normalize([1.0], 2)
    assert "returned 1 values for 2 completions" in short.errors[0][1]
    mixed = normalize([1.0, "x", float("inf")], 3)
    assert mixed.values[0] == 1.0 and is_nan(mixed.values[1]) and is_nan(mixed.values[2])
    assert [index for index, _ in mixed.errors] == [1, 2]


def test_sample_slices_only_per_sample_lists():
    call = make_call(["a", "b"], answer=["1", "2"], trainer_state={"step": 3}, pair=[1, 2, 3])
    one = call.sample(1)
    assert one.completions == ["b"] and one.prompts == ["p"] and one.completion_ids == [[1]]
    assert one.columns == {"answer": ["2"], "trainer_state": {"step": 3}, "pair": [1, 2, 3]}


def fails_on_b(completions, **kwargs):
    if "b" in completions:
        raise ValueError("cannot score b")
    return [1.0] * len(completions)


def test_evaluate_isolates_the_failing_sample():
    outcome = evaluate(fails_on_b, make_call(["a", "b", "c"]))
    assert outcome.values[0] == 1.0 and is_nan(outcome.values[1]) and outcome.values[2] == 1.0
    ((index, message),) = outcome.errors
    assert index == 1
    assert "ValueError: cannot score b" in message and "'b'" in message and "test_evaluate.py" in message


def test_evaluate_batch_only_failure_keeps_values():
    def batch_only(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batch too big")
        return [2.0]

    outcome = evaluate(batch_only, make_call(["a", "b"]))
    assert outcome.values == [2.0, 2.0]
    assert outcome.errors[0][0] is None and "on no single sample" in outcome.errors[0][1]
