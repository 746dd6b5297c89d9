import math

import pytest
import torch
from helpers.support import save_reward_model

from grpoflow.rewards import RewardModel, RewardRunner

CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("reward_model"))


def test_scores_are_batched_with_padding(model_dir):
    model = RewardModel(model_dir, max_length=64, batch_size=3)
    prompts = ["what is 2+2? ", "hi ", "count: ", "x"]
    completions = ["4", "hello there, friend", "1 2 3 4 5 6", "y"]
    batched = model(prompts=prompts, completions=completions, completion_ids=[[1]] * 4)
    one_by_one = RewardModel(model_dir, max_length=64, batch_size=1)(prompts=prompts, completions=completions)
    assert len(batched) == 4 and all(isinstance(v, float) and math.isfinite(v) for v in batched)
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    assert len(set(batched)) > 1


def test_long_inputs_keep_their_end(model_dir):
    model = RewardModel(model_dir, max_length=8)
    short = model(prompts=["p"], completions=["abcdefgh"])
    long = model(prompts=["zzzzzzzzzzzzzzzz"], completions=["abcdefgh"])
    assert short == pytest.approx(long, abs=1e-5)  # only the last 8 tokens are scored


def test_conversations_use_the_chat_template(tmp_path):
    model = RewardModel(save_reward_model(tmp_path, CHAT_TEMPLATE), max_length=64)
    prompt = [{"role": "user", "content": "2+2?"}]
    completion = [{"role": "assistant", "content": "4"}]
    assert model.texts([prompt], [completion]) == ["user: 2+2?\nassistant: 4\n"]
    assert model.texts([prompt], ["4"]) == ["user: 2+2?\nassistant: 4\n"]
    (score,) = model(prompts=[prompt], completions=[completion])
    assert math.isfinite(score)


def test_conversations_without_template_are_concatenated(model_dir):
    model = RewardModel(model_dir)
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    completion = [{"role": "assistant", "content": "4"}]
    assert model.texts([prompt], [completion]) == ["be brief\n2+2?4"]
    assert model.texts(["2+2? "], ["4"]) == ["2+2? 4"]


def test_reward_model_in_the_runner(model_dir):
    model = RewardModel(model_dir)
    with RewardRunner([("rm", model)], timeout=30, num_workers=0) as runner:
        batch = runner.score(["a", "b"], ["c", "d"], [[1], [1]], {})
    assert batch.errors == [] and torch.isfinite(batch.values).all()
    assert batch.values[:, 0].tolist() == pytest.approx(
        model(prompts=["a", "b"], completions=["c", "d"]), abs=1e-5
    )
