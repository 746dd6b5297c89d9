import pytest

from grpoflow.rewards import RewardConfig


def test_defaults_follow_ms_swift():
    config = RewardConfig()
    assert (config.cosine_min_len_value_wrong, config.cosine_max_len_value_wrong) == (-0.5, 0.0)
    assert (config.cosine_min_len_value_correct, config.cosine_max_len_value_correct) == (1.0, 0.5)
    assert (config.repetition_n_grams, config.repetition_max_penalty) == (3, -1.0)
    assert config.effective_cosine_max_len == config.effective_soft_max_length == 512
    assert (config.reward_timeout, config.reward_num_workers) == (60.0, 2)


def test_unset_lengths_follow_max_completion_length():
    config = RewardConfig(max_completion_length=100, cosine_max_len=None, soft_max_length=None)
    assert config.effective_cosine_max_len == 100
    assert config.effective_soft_max_length == 100
    assert RewardConfig(cosine_max_len=7, soft_max_length=9).effective_cosine_max_len == 7


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"repetition_max_penalty": 0.5}, "repetition_max_penalty"),
        ({"repetition_n_grams": 0}, "repetition_n_grams"),
        ({"cosine_max_len": 0}, "cosine_max_len"),
        ({"max_completion_length": 0}, "max_completion_length"),
        ({"soft_max_length": 0}, "soft_max_length"),
        ({"soft_cache_length": 512}, "soft_cache_length"),
        ({"soft_max_length": 100, "soft_cache_length": 0}, "soft_cache_length"),
        ({"reward_timeout": 0}, "reward_timeout"),
        ({"reward_num_workers": -1}, "reward_num_workers"),
    ],
)
def test_bad_values_name_the_field(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        RewardConfig(**kwargs)


def test_fields_are_keyword_only():
    with pytest.raises(TypeError):
        RewardConfig(-0.5)
