import pytest
import torch
from helpers.native_fixtures import one_thread  # noqa: F401 (a fixture)

from grpoflow.engines import EngineConfig, EngineOptions, RolloutEngine, SamplingParams, build_engine
from grpoflow.engines.hf import HFEngine, left_pad
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(len(tokenizer), seed=0)


@pytest.fixture
def engine(model, tokenizer):
    return HFEngine(model, tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Two prompts of different lengths, so that the batch is left-padded."""
    return [tokenizer("echo a:")["input_ids"], tokenizer("hi")["input_ids"]]


def sample(engine, prompts, **kwargs):
    """Token ids of every completion, prompt by prompt."""
    return [[c.token_ids for c in group] for group in engine.generate(prompts, SamplingParams(**kwargs))]


def reference_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / T) at the sampled tokens, from one unpadded forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]
    scores = torch.log_softmax(logits[len(prompt) - 1 : -1].float() / temperature, dim=-1)
    return scores.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def first_new_token(row, other_rows, start=1):
    """A token at position k >= start of `row` seen nowhere before it in `row` nor in `other_rows`."""
    for position in range(start, len(row) - 1):
        token = row[position]
        if token > 1 and token not in row[:position] and all(token not in other for other in other_rows):
            return position, token
    raise AssertionError(f"no usable token in {row}: pick another seed")


def test_engine_satisfies_the_interface(engine, model, tokenizer):
    assert isinstance(engine, RolloutEngine)
    assert engine.shares_policy_weights
    built = build_engine(
        "hf", model, tokenizer, EngineOptions(engine=EngineConfig(max_model_len=64), logprob_chunk_size=7)
    )
    assert isinstance(built, HFEngine)
    assert built.logprob_chunk_size == 7
    with pytest.raises(ValueError, match="unknown rollout engine 'vllm2'; known: .*hf"):
        build_engine("vllm2", model, tokenizer, EngineOptions(engine=EngineConfig(max_model_len=64)))


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], 0, "cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_n_completions_per_prompt(engine, prompts, tokenizer):
    params = SamplingParams(n=3, max_tokens=5, seed=0, stop_token_ids=[tokenizer.eos_token_id])
    groups = engine.generate(prompts, params)
    assert [len(group) for group in groups] == [3, 3]
    for group in groups:
        for completion in group:
            assert 1 <= len(completion.token_ids) <= 5
            assert len(completion.logprobs) == len(completion.token_ids)
            assert all(value <= 0 for value in completion.logprobs)
            assert completion.finish_reason in {"stop", "length"}
            assert completion.policy_version == 0
    # completions of one prompt are sampled independently
    assert len({tuple(c.token_ids) for c in groups[0]}) > 1
    assert engine.stats.num_prompt_tokens == 3 * (len(prompts[0]) + len(prompts[1]))
    assert engine.stats.num_generated_tokens == sum(len(c.token_ids) for group in groups for c in group)


def test_greedy_matches_model_generate_one_prompt_at_a_time(engine, model, prompts):
    batched = sample(engine, prompts, n=2, max_tokens=6, temperature=0, ignore_eos=True)
    for prompt, group in zip(prompts, batched):
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert group == [expected, expected]


def test_stop_token_ends_a_completion_and_is_kept(engine, prompts):
    free = sample(engine, prompts, max_tokens=12, seed=3, ignore_eos=True)
    (first,), (second,) = free
    position, stop_token = first_new_token(first, [second])
    groups = engine.generate(prompts, SamplingParams(max_tokens=12, seed=3, stop_token_ids=[stop_token]))
    assert groups[0][0].token_ids == first[: position + 1]
    assert groups[0][0].finish_reason == "stop"
    assert not groups[0][0].truncated
    assert len(groups[0][0].logprobs) == position + 1
    assert groups[1][0].token_ids == second
    assert groups[1][0].finish_reason == "length"
    assert groups[1][0].truncated


def test_greedy_stop_on_the_repeated_token(engine, prompts):
    (free,), _ = sample(engine, prompts, max_tokens=4, temperature=0, ignore_eos=True)
    token = free[0]
    params = SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[token])
    completion = engine.generate(prompts[:1], params)[0][0]
    assert (completion.token_ids, completion.finish_reason) == ([token], "stop")


def test_ignore_eos_generates_exactly_max_tokens(engine, prompts):
    # Greedy decoding repeats one token; make it the stop token and ignore it.
    (free,), _ = sample(engine, prompts, max_tokens=4, temperature=0, ignore_eos=True)
    params = SamplingParams(n=2, max_tokens=7, temperature=0, stop_token_ids=[free[0]], ignore_eos=True)
    for group in engine.generate(prompts, params):
        for completion in group:
            assert len(completion.token_ids) == 7
            assert completion.finish_reason == "length"
    sampled = SamplingParams(n=4, max_tokens=9, seed=1, stop_token_ids=[1, free[0]], ignore_eos=True)
    assert {len(c.token_ids) for group in engine.generate(prompts, sampled) for c in group} == {9}


@pytest.mark.parametrize("with_eos", [True, False], ids=["with-stop-token", "without-stop-token"])
def test_stop_string_ends_a_completion(engine, prompts, tokenizer, with_eos):
    stop_ids = [tokenizer.eos_token_id] if with_eos else []
    # the first seed whose two completions both run to max_tokens
    seed, (first, second) = next(
        (seed, rows)
        for seed in range(20)
        for rows in [[group[0] for group in sample(engine, prompts, max_tokens=12, seed=seed)]]
        if tokenizer.eos_token_id not in rows[0] + rows[1]
    )
    position, token = first_new_token(first, [second])
    stop = tokenizer.decode([token])
    params = SamplingParams(max_tokens=12, seed=seed, stop_token_ids=stop_ids, stop=[stop])
    groups = engine.generate(prompts, params)
    assert groups[0][0].token_ids == first[: position + 1]
    assert groups[0][0].finish_reason == "stop"
    assert len(groups[0][0].logprobs) == position + 1
    assert groups[1][0].token_ids == second
    assert groups[1][0].finish_reason == "length"


def test_logprobs_match_a_separate_forward_pass(engine, model, prompts):
    groups = engine.generate(prompts, SamplingParams(n=3, max_tokens=8, temperature=TEMPERATURE, seed=11))
    for prompt, group in zip(prompts, groups):
        for completion in group:
            expected = reference_logprobs(model, prompt, completion.token_ids, TEMPERATURE)
            torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=1e-4)
    # the temperature matters: at T=1 the same tokens score differently
    completion = groups[0][0]
    at_one = reference_logprobs(model, prompts[0], completion.token_ids, 1.0)
    assert not torch.allclose(torch.tensor(completion.logprobs), at_one, atol=1e-3)


def test_greedy_logprobs_use_temperature_one(engine, model, prompts):
    completion = engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))[0][0]
    expected = reference_logprobs(model, prompts[0], completion.token_ids, 1.0)
    torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_a_seed_reproduces_the_samples(engine, prompts):
    first = sample(engine, prompts, n=2, max_tokens=8, seed=7)
    assert sample(engine, prompts, n=2, max_tokens=8, seed=7) == first
    assert sample(engine, prompts, n=2, max_tokens=8, seed=8) != first


def test_a_seed_leaves_the_global_generator_alone(engine, prompts):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine.generate(prompts, SamplingParams(max_tokens=4, seed=7))
    assert torch.equal(torch.rand(3), expected)


def test_empty_prompt_raises(engine, prompts):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([prompts[0], []], SamplingParams(max_tokens=4))


class ModeRecorder:
    """A forward pre-hook that records the model's mode, and can fail on demand."""

    def __init__(self, fail: bool = False):
        self.modes, self.fail = [], fail

    def __call__(self, module, args, kwargs):
        self.modes.append(module.training)
        if self.fail:
            raise RuntimeError("forward failed")


@pytest.mark.parametrize("training", [True, False])
def test_generation_runs_in_eval_mode_and_restores_the_mode(tokenizer, prompts, training):
    model = build_tiny_model(len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    model.train(training)
    recorder = ModeRecorder()
    handle = model.register_forward_pre_hook(recorder, with_kwargs=True)
    HFEngine(model, tokenizer).generate(prompts, SamplingParams(max_tokens=3))
    handle.remove()
    assert recorder.modes and not any(recorder.modes)
    assert model.training is training
    assert all(module.training is training for module in model.modules())


def test_mode_is_restored_when_generation_fails(tokenizer, prompts):
    model = build_tiny_model(len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    model.train()
    model.register_forward_pre_hook(ModeRecorder(fail=True), with_kwargs=True)
    with pytest.raises(RuntimeError, match="forward failed"):
        HFEngine(model, tokenizer).generate(prompts, SamplingParams(max_tokens=3))
    assert model.training


def small_model(tokenizer, seed):
    return build_tiny_model(
        len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, seed=seed
    )


def test_update_weights_copies_foreign_tensors(tokenizer, prompts):
    model, other = small_model(tokenizer, seed=0), small_model(tokenizer, seed=1)
    engine = HFEngine(model, tokenizer)
    engine.update_weights(other.named_parameters(), version=3)
    for (name, mine), (_, theirs) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(mine, theirs), name
        assert mine.data_ptr() != theirs.data_ptr(), name
    assert engine.policy_version == 3
    params = SamplingParams(max_tokens=5, seed=2)
    (completion,), _ = engine.generate(prompts, params)
    assert completion.policy_version == 3
    assert completion.token_ids == HFEngine(other, tokenizer).generate(prompts, params)[0][0].token_ids


def test_update_weights_accepts_a_state_dict_with_tied_names(tokenizer):
    model, other = small_model(tokenizer, seed=0), small_model(tokenizer, seed=1)
    state = other.state_dict()
    assert "lm_head.weight" in state  # tied to the embeddings, listed under both names
    HFEngine(model, tokenizer).update_weights(state.items(), version=1)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_update_weights_with_its_own_parameters_only_bumps_the_version(engine, model):
    before = {name: tensor.clone() for name, tensor in model.named_parameters()}
    engine.update_weights(model.named_parameters(), version=5)
    assert engine.policy_version == 5
    for name, tensor in model.named_parameters():
        assert torch.equal(tensor, before[name])


def test_update_weights_unknown_name(tokenizer):
    model = small_model(tokenizer, seed=0)
    engine = HFEngine(model, tokenizer)
    with pytest.raises(ValueError, match="no parameter named 'model.layers.9.mlp.up_proj.weight'"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))], version=1)
    assert engine.policy_version == 0


def test_sleep_and_wake_up_keep_generation_working(engine, prompts):
    engine.sleep(level=1)
    engine.wake_up()
    assert len(engine.generate(prompts, SamplingParams(max_tokens=2))) == 2
