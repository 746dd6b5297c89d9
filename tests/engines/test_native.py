"""The native engine on the CPU: exactness against transformers, sampling statistics, scheduling,
stops, seeds, sleep, bad requests, the generic path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.native_fixtures import (
    FAMILIES,
    VOCAB_SIZE,
    chi_square,
    chi_square_critical,
    forward_logprobs,
    hf_greedy,
    one_thread,  # noqa: F401 (a fixture)
    tiny,
)
from transformers import GPT2Config, GPT2LMHeadModel

from grpoflow.engines.base import RolloutEngine, SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.engines.native.sampler import SamplingOptions, sample, sample_reference
from grpoflow.policy.tiny import build_char_tokenizer

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(2, 40)), [3] * 17]


def engine(model, **kwargs) -> NativeEngine:
    config = dict(max_num_seqs=8, block_size=4, num_kv_blocks=256)
    config.update(kwargs)
    return NativeEngine(model, config=NativeEngineConfig(**config))


def greedy(max_tokens: int = 64, n: int = 1, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_matches_transformers(model_type):
    model = tiny(model_type)
    native = engine(model)
    assert native.path == "family"
    outputs = native.generate(PROMPTS, greedy(64, n=2))
    for prompt, completions in zip(PROMPTS, outputs):
        reference = hf_greedy(model, prompt, 64)
        assert [completion.token_ids for completion in completions] == [reference, reference]
        assert all(completion.finish_reason == "length" for completion in completions)


def test_engine_satisfies_protocol():
    native = engine(tiny())
    assert isinstance(native, RolloutEngine)
    assert native.shares_policy_weights


def test_more_requests_than_rows_and_preemption():
    """3 rows for 8 sequences, and a cache so small that sequences are preempted and recomputed."""
    model = tiny("llama")
    native = engine(model, max_num_seqs=3, num_kv_blocks=40)
    outputs = native.generate(PROMPTS, greedy(64, n=2))
    for prompt, completions in zip(PROMPTS, outputs):
        reference = hf_greedy(model, prompt, 64)
        assert all(completion.token_ids == reference for completion in completions)
    assert native.stats.extra["preemptions"] > 0


def test_logprobs_match_a_forward_pass():
    model = tiny("qwen2")
    params = SamplingParams(temperature=0.7, max_tokens=24, n=3, ignore_eos=True, seed=1)
    outputs = engine(model).generate(PROMPTS[:2], params)
    for prompt, completions in zip(PROMPTS, outputs):
        for completion in completions:
            expected = forward_logprobs(model, prompt, completion.token_ids, 0.7)
            np.testing.assert_allclose(completion.logprobs, expected, atol=1e-4)


def _draw_counts(logits: torch.Tensor, options: SamplingOptions, draws: int) -> torch.Tensor:
    rows = logits[None, :].expand(draws, -1)
    keys = torch.from_numpy(np.random.default_rng(0).integers(0, 2**32, draws))
    tokens, _ = sample(rows, keys, options)
    return torch.bincount(tokens, minlength=logits.shape[0])


def _reference_probs(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    scaled = logits / options.temperature
    probs = scaled.softmax(-1)
    order = probs.argsort(descending=True)
    kept = torch.zeros_like(probs, dtype=torch.bool)
    if options.top_k > 0:
        kept[order[: options.top_k]] = True
    else:
        kept[:] = True
    if options.top_p < 1:
        renormalised = torch.where(kept, probs, 0) / probs[kept].sum()
        mass = 0.0
        nucleus = torch.zeros_like(kept)
        for token in order.tolist():
            if kept[token] and mass < options.top_p:
                nucleus[token] = True
                mass += renormalised[token].item()
        kept = nucleus
    if options.min_p > 0:
        kept &= probs >= options.min_p * probs.max()
    filtered = torch.where(kept, probs, 0)
    return filtered / filtered.sum()


@pytest.mark.parametrize(
    "options",
    [
        SamplingOptions.from_params(SamplingParams(temperature=1.0)),
        SamplingOptions.from_params(SamplingParams(temperature=0.6)),
        SamplingOptions.from_params(SamplingParams(temperature=1.3, top_p=0.7)),
        SamplingOptions.from_params(SamplingParams(temperature=0.9, top_k=4)),
        SamplingOptions.from_params(SamplingParams(temperature=1.0, top_k=6, top_p=0.8)),
        SamplingOptions.from_params(SamplingParams(temperature=1.0, min_p=0.2)),
    ],
    ids=["t1", "t0.6", "top_p", "top_k", "top_k_top_p", "min_p"],
)
def test_sampling_frequencies_match_the_distribution(options):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(3)) * 1.5
    counts = _draw_counts(logits, options, 40000)
    statistic, degrees = chi_square(counts, _reference_probs(logits, options))
    assert statistic < chi_square_critical(degrees), (statistic, degrees)
    wrong = SamplingOptions.from_params(
        SamplingParams(temperature=options.temperature * 1.25, top_p=min(1.0, options.top_p + 0.2))
    )
    wrong_statistic, wrong_degrees = chi_square(counts, _reference_probs(logits, wrong))
    assert wrong_statistic > chi_square_critical(wrong_degrees), "the test must see a wrong distribution"


def test_engine_first_tokens_follow_softmax():
    model = tiny("qwen3")
    prompt = [4, 5, 6, 7]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    params = SamplingParams(temperature=0.8, max_tokens=1, n=4000, seed=0)
    outputs = engine(model, max_num_seqs=512, num_kv_blocks=4096).generate([prompt], params)
    tokens = torch.tensor([completion.token_ids[0] for completion in outputs[0]])
    statistic, degrees = chi_square(torch.bincount(tokens, minlength=VOCAB_SIZE), (logits / 0.8).softmax(-1))
    assert statistic < chi_square_critical(degrees)


def test_filters_reduce_to_thresholds():
    scaled = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert SamplingOptions.from_params(SamplingParams(top_k=2)).truncation.thresholds(scaled).item() == 2.0
    assert SamplingOptions.from_params(SamplingParams(top_p=0.5)).truncation.thresholds(scaled).item() == 3.0
    tokens, logprobs = sample_reference(scaled, torch.zeros(1, dtype=torch.long), 1.0, True, None)
    assert tokens.item() == 0
    assert logprobs.item() == pytest.approx(scaled.log_softmax(-1)[0, 0].item())


@pytest.mark.parametrize("generic", [False, True])
def test_repetition_penalty_and_top_k_one_match_transformers(generic):
    model = tiny("qwen2")
    native = engine(model, force_generic=generic)
    prompt = PROMPTS[3]
    penalised = native.generate([prompt], greedy(32, repetition_penalty=1.5))[0][0]
    assert penalised.token_ids == hf_greedy(model, prompt, 32, repetition_penalty=1.5)
    top_one = SamplingParams(temperature=1.3, top_k=1, max_tokens=32, ignore_eos=True)
    assert native.generate([prompt], top_one)[0][0].token_ids == hf_greedy(model, prompt, 32)


def test_in_place_optimizer_step_is_seen_by_next_generate():
    model = tiny("qwen2")
    native = engine(model)
    prompt = PROMPTS[0]
    before = native.generate([prompt], greedy(32))[0][0].token_ids
    assert before == hf_greedy(model, prompt, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    loss = (
        model(torch.tensor([prompt + before])).logits.logsumexp(-1).mean()
        - model(torch.tensor([prompt + before])).logits[0, :, 9].mean()
    )
    loss.backward()
    pointers = [parameter.data_ptr() for parameter in model.parameters()]
    optimizer.step()
    assert pointers == [parameter.data_ptr() for parameter in model.parameters()]
    native.update_weights([], version=1)
    after = native.generate([prompt], greedy(32))[0]
    assert after[0].token_ids == hf_greedy(model, prompt, 32)
    assert after[0].token_ids != before
    assert after[0].policy_version == 1


def test_update_weights_copies_foreign_tensors():
    model, other = tiny("qwen2", seed=0), tiny("qwen2", seed=1)
    native = engine(model)
    native.update_weights(other.state_dict().items(), version=3)
    assert native.generate([PROMPTS[0]], greedy(16))[0][0].token_ids == hf_greedy(other, PROMPTS[0], 16)
    with pytest.raises(ValueError, match="no parameter named"):
        native.update_weights([("nope.weight", torch.zeros(1))], version=4)


def test_stop_tokens_ignore_eos_and_max_tokens():
    model = tiny("qwen2")
    native = engine(model)
    prompt = PROMPTS[2]
    reference = hf_greedy(model, prompt, 40)
    stop = reference[5]
    first = reference.index(stop)
    stops = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])
    stopped = native.generate([prompt], stops)[0][0]
    assert stopped.token_ids == reference[: first + 1]
    assert stopped.finish_reason == "stop"
    ignored = native.generate([prompt], greedy(40, stop_token_ids=[stop]))[0][0]
    assert ignored.token_ids == reference and ignored.finish_reason == "length"
    short = native.generate([prompt], greedy(7))[0][0]
    assert short.token_ids == reference[:7] and short.truncated


def test_stop_strings():
    tokenizer = build_char_tokenizer()
    model = tiny("llama")
    native = NativeEngine(
        model, config=NativeEngineConfig(max_num_seqs=4, num_kv_blocks=128, block_size=4), tokenizer=tokenizer
    )
    prompt = tokenizer("abc")["input_ids"]
    reference = hf_greedy(model, prompt, 30)
    text = tokenizer.decode(reference)
    stop = text[8:10]
    completion = native.generate([prompt], greedy(30, stop=[stop]))[0][0]
    assert completion.finish_reason == "stop"
    assert stop in tokenizer.decode(completion.token_ids)
    assert stop not in tokenizer.decode(completion.token_ids[:-1])
    assert completion.text == text[: text.index(stop)]
    with pytest.raises(ValueError, match="tokenizer"):
        engine(model).generate([prompt], greedy(4, stop=["x"]))


def test_seed_reproducible_whatever_the_batch():
    model = tiny("qwen2")
    params = SamplingParams(temperature=1.0, max_tokens=20, n=3, seed=7, ignore_eos=True)
    alone = engine(model).generate([PROMPTS[1]], params)[0]
    crowded = engine(model, max_num_seqs=2).generate([PROMPTS[0], PROMPTS[1]], params)[1]
    assert [c.token_ids for c in alone] == [c.token_ids for c in crowded]
    assert len({tuple(c.token_ids) for c in alone}) > 1, "the n samples differ"
    other = engine(model).generate([PROMPTS[1]], SamplingParams(temperature=1.0, max_tokens=20, n=3, seed=8))[
        0
    ]
    assert [c.token_ids for c in other] != [c.token_ids for c in alone]


def test_sleep_releases_cache_and_wake_up_restores():
    model = tiny("mistral")
    native = engine(model)
    first = native.generate([PROMPTS[0]], greedy(16))
    native.sleep()
    assert not native.runner.awake
    native.wake_up()
    assert native.runner.awake
    assert native.generate([PROMPTS[0]], greedy(16)) == first
    native.sleep(level=2)
    assert native.generate([PROMPTS[0]], greedy(16)) == first, "generate wakes a sleeping engine"


def test_the_cache_takes_the_dtype_the_weights_have_when_the_engine_wakes():
    """FSDP's mixed precision gathers float32 shards in bfloat16 for a rollout: the engine, built
    on the shards, computes in the gathered weights' dtype (greedy tokens as transformers')."""
    model = tiny("qwen3")
    native = engine(model)
    native.sleep()
    model.to(torch.bfloat16)
    assert native.generate([PROMPTS[0]], greedy(8))[0][0].token_ids == hf_greedy(model, PROMPTS[0], 8)
    assert native.runner.cache.dtype == torch.bfloat16


def test_bad_requests_raise_and_leave_engine_serving():
    model = tiny("qwen2", max_position_embeddings=64)
    native = engine(model, num_kv_blocks=12)
    good = [5, 6, 7]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        native.generate([good, []], greedy(8))
    with pytest.raises(ValueError, match="prompt 0 has 64 tokens"):
        native.generate([[3] * 64], greedy(8))
    with pytest.raises(ValueError, match="prompt 0 has token ids outside"):
        native.generate([[VOCAB_SIZE]], greedy(8))
    with pytest.raises(ValueError, match="needs up to 60 tokens of KV cache"):
        native.generate([[3] * 50], greedy(10))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    bad_params = greedy(8)
    bad_params.max_tokens = 0
    with pytest.raises(ValueError, match="prompt 0: max_tokens"):
        native.generate([good], bad_params)
    outputs = native.generate([good, [], good], greedy(8), on_error="error_completion")
    assert outputs[1][0].finish_reason == "error" and "empty" in outputs[1][0].text
    assert outputs[0][0].token_ids == outputs[2][0].token_ids == hf_greedy(model, good, 8)


def test_generic_path_for_other_architectures():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB_SIZE)).eval()
    native = NativeEngine(model, config=NativeEngineConfig(max_num_seqs=3))
    assert native.path == "generic"
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    outputs = native.generate(prompts, greedy(24, n=2))
    for prompt, completions in zip(prompts, outputs):
        reference = hf_greedy(model, prompt, 24)
        assert all(completion.token_ids == reference for completion in completions)
    sampled = native.generate(prompts[:1], SamplingParams(temperature=0.9, max_tokens=12, n=2, seed=3))[0]
    for completion in sampled:
        expected = forward_logprobs(model, prompts[0], completion.token_ids, 0.9)
        np.testing.assert_allclose(completion.logprobs, expected, atol=1e-4)


def test_completions_converted_ahead_equal_converted_at_the_end():
    from grpoflow.engines.native.requests import RequestBook

    params = [SamplingParams(max_tokens=6, n=2, ignore_eos=True), SamplingParams(max_tokens=3, n=1)]
    books = [RequestBook([[1, 2], [3]], params, [None, None], seed=0, max_model_len=64) for _ in range(2)]
    rng = np.random.default_rng(0)
    for step in range(6):
        sequences = np.nonzero(~books[0].done)[0]
        tokens = rng.integers(4, 50, len(sequences))
        logprobs = rng.random(len(sequences)).astype(np.float32)
        for book in books:
            book.record(sequences, tokens, logprobs)
        if step in (1, 4):
            books[1].convert_ahead()  # twice: the later conversion is the one used
    plain, ahead = (book.completions(0) for book in books)
    assert [[c.token_ids for c in group] for group in plain] == [
        [c.token_ids for c in group] for group in ahead
    ]
    assert [[c.logprobs for c in group] for group in plain] == [
        [c.logprobs for c in group] for group in ahead
    ]
    assert [len(c.token_ids) for group in plain for c in group] == [6, 6, 3]


def test_generate_pauses_garbage_collection(monkeypatch):
    import gc

    from grpoflow.engines.native.requests import RequestBook

    seen = []
    completions = RequestBook.completions
    monkeypatch.setattr(
        RequestBook,
        "completions",
        lambda book, *args: seen.append(gc.isenabled()) or completions(book, *args),
    )
    native = engine(tiny("qwen2"))
    native.generate([PROMPTS[0]], greedy(3))
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ValueError):
        native.generate([[]], greedy(3))
    assert gc.isenabled()
