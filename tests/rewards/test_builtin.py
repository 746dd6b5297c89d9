import math
import pickle

import pytest

from grpoflow.rewards import RewardConfig, get_reward
from grpoflow.rewards.builtin import cosine_schedule, repetition_ratio, soft_overlong_penalty


def test_format():
    reward = get_reward("format")
    completions = [
        "<think>2 + 2</think><answer>4</answer>",
        "  <think>a\nb</think>\n\n<answer>\n4\n</answer>\n",
        "<think>2 + 2</think>",
        "<answer>4</answer>",
        "<think>x</think><answer>4</answer> trailing",
        "lead <think>x</think><answer>4</answer>",
        [{"role": "assistant", "content": "<think>x</think><answer>4</answer>"}],
    ]
    assert reward(completions=completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_cosine_schedule_hand_values():
    assert cosine_schedule(0, 100, 1.0, 0.5) == pytest.approx(1.0)
    assert cosine_schedule(50, 100, 1.0, 0.5) == pytest.approx(0.75)
    assert cosine_schedule(100, 100, 1.0, 0.5) == pytest.approx(0.5)
    assert cosine_schedule(25, 100, -0.5, 0.0) == pytest.approx(
        0.0 + 0.5 * (-0.5 - 0.0) * (1 + math.cos(math.pi / 4))
    )
    assert cosine_schedule(400, 100, 1.0, 0.5) == pytest.approx(0.5)  # clamped past the end


def test_cosine_correct_shrinks_and_wrong_grows_with_length():
    reward = get_reward("cosine", RewardConfig(cosine_max_len=90))
    lengths = [0, 30, 45, 90, 200]
    ids = [[7] * n for n in lengths]
    correct = reward(completions=["<answer>72</answer>"] * 5, completion_ids=ids, answer=["#### 72"] * 5)
    wrong = reward(completions=["<answer>71</answer>"] * 5, completion_ids=ids, answer=["#### 72"] * 5)
    # cos(pi/3) = 0.5: correct 0.5 + 0.25 * 1.5 = 0.875; wrong 0 - 0.25 * 1.5 = -0.375
    assert correct == pytest.approx([1.0, 0.875, 0.75, 0.5, 0.5])
    assert wrong == pytest.approx([-0.5, -0.375, -0.25, 0.0, 0.0])


def test_cosine_uses_custom_values_and_max_completion_length():
    config = RewardConfig(
        max_completion_length=10, cosine_min_len_value_correct=2.0, cosine_max_len_value_correct=0.0
    )
    reward = get_reward("cosine", config)
    assert reward(completions=["72"], completion_ids=[[1] * 5], answer=["#### 72"]) == pytest.approx([1.0])


def test_cosine_missing_gold_and_missing_ids():
    reward = get_reward("cosine")
    assert reward(completions=["72"], completion_ids=[[1]], solution=[""]) == [None]
    with pytest.raises(ValueError, match="completion_ids"):
        reward(completions=["72"], completion_ids=None, answer=["#### 72"])


def test_repetition():
    assert repetition_ratio("a b c a b c", 3) == pytest.approx(0.25)  # abc bca cab abc: 3 of 4 unique
    assert repetition_ratio("a b", 3) == 0.0
    reward = get_reward("repetition")
    completions = [
        "a b c a b c",
        "one two three four",
        "hi",
        "x x x x x",
        [{"role": "assistant", "content": "a a a a"}],
    ]
    # "x x x x x": 3 trigrams, 1 unique -> ratio 2/3; "a a a a": 2 trigrams, 1 unique -> 1/2
    assert reward(completions=completions) == pytest.approx([-0.25, 0.0, 0.0, -2 / 3, -0.5])
    strong = get_reward("repetition", RewardConfig(repetition_n_grams=1, repetition_max_penalty=-2.0))
    assert strong(completions=["a a b b"]) == pytest.approx([-1.0])


def test_soft_overlong_hand_values():
    assert [soft_overlong_penalty(n, 100, 20) for n in (50, 80, 81, 90, 100, 101, 500)] == pytest.approx(
        [0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0]
    )
    reward = get_reward("soft_overlong", RewardConfig(soft_max_length=100, soft_cache_length=20))
    ids = [[1] * n for n in (10, 90, 120)]
    assert reward(completions=["a", "b", "c"], completion_ids=ids) == pytest.approx([0.0, -0.5, -1.0])


def test_soft_overlong_defaults_to_max_completion_length():
    reward = get_reward("soft_overlong", RewardConfig(max_completion_length=40, soft_cache_length=10))
    assert reward(completions=["a"], completion_ids=[[1] * 35]) == pytest.approx([-0.5])


def test_soft_overlong_needs_cache_length():
    with pytest.raises(ValueError, match="soft_cache_length"):
        get_reward("soft_overlong", RewardConfig())


@pytest.mark.parametrize("name", ["accuracy", "format", "cosine", "repetition", "soft_overlong"])
def test_builtins_pickle(name):
    reward = get_reward(name, RewardConfig(soft_cache_length=10))
    assert pickle.loads(pickle.dumps(reward)) is not None
