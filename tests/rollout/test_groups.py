import pytest
import torch

from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion, EngineCapabilities, EngineStats, SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model
from grpoflow.rollout.batch import collate
from grpoflow.rollout.groups import Group, SingleTurn, generate_groups, reward_inputs

PAD = 0


def completion(token_ids, finish_reason="stop", logprobs=None) -> Completion:
    if logprobs is None:
        logprobs = [-0.1 * (index + 1) for index in range(len(token_ids))]
    return Completion(token_ids=list(token_ids), logprobs=logprobs, finish_reason=finish_reason)


def group(prompt_ids, completions, prompt="p", columns=None) -> Group:
    item = PromptItem(prompt=prompt, prompt_ids=list(prompt_ids), columns=columns or {})
    return Group(item=item, completions=completions, texts=[f"t{c.token_ids}" for c in completions])


@pytest.fixture
def groups():
    return [
        group([5, 6], [completion([7, 8, 9], "length"), completion([1])], prompt="first"),
        group([4, 5, 6, 7], [completion([9, 1]), completion([], "stop")], prompt="second"),
    ]


def test_collate_pads_prompts_left_and_completions_right(groups):
    batch = collate(groups, PAD, torch.device("cpu"))
    assert len(batch) == 4
    assert batch.prompt_ids.tolist() == [[0, 0, 5, 6], [0, 0, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7]]
    assert batch.prompt_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert batch.completion_ids.tolist() == [[7, 8, 9], [1, 0, 0], [9, 1, 0], [0, 0, 0]]
    assert batch.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]]
    assert batch.truncated.tolist() == [True, False, False, False]
    assert batch.truncated.dtype == torch.bool
    assert batch.prompt_ids.dtype == batch.completion_ids.dtype == torch.long


def test_collate_places_sampling_logprobs_under_their_tokens(groups):
    batch = collate(groups, PAD, torch.device("cpu"))
    assert batch.sampling_logps.dtype == torch.float32
    expected = torch.tensor(
        [[-0.1, -0.2, -0.3], [-0.1, 0.0, 0.0], [-0.1, -0.2, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float32
    )
    torch.testing.assert_close(batch.sampling_logps, expected)
    assert (batch.sampling_logps[batch.completion_mask == 0] == 0).all()


def test_collate_places_each_completions_loss_mask_under_its_tokens(groups):
    inserted = Completion(token_ids=[7, 8, 9, 2], logprobs=[0.0] * 4, finish_reason="stop", mask=[1, 0, 0, 1])
    batch = collate([group([5], [inserted, completion([1, 2])])], PAD, torch.device("cpu"))
    assert batch.loss_mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    assert batch.completion_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert collate(groups, PAD, torch.device("cpu")).loss_mask.tolist() == [
        [1, 1, 1],
        [1, 0, 0],
        [1, 1, 0],
        [0, 0, 0],
    ]


def test_collate_uses_the_pad_id():
    batch = collate([group([3], [completion([4]), completion([4, 5])])], 99, torch.device("cpu"))
    assert batch.completion_ids.tolist() == [[4, 99], [4, 5]]
    batch = collate(
        [group([3], [completion([4])]), group([2, 3], [completion([4])])], 99, torch.device("cpu")
    )
    assert batch.prompt_ids.tolist() == [[99, 3], [2, 3]]


def test_collate_names_a_completion_whose_logprobs_miss_tokens():
    short = completion([7, 8, 9], logprobs=[-0.1, -0.2])
    with pytest.raises(
        ValueError, match="completions. logprobs hold 3 values for 4 positions: give one per token"
    ):
        collate([group([5], [short, completion([1])])], PAD, torch.device("cpu"))


def test_collate_keeps_one_column_when_every_completion_is_empty():
    batch = collate([group([3], [completion([]), completion([])])], PAD, torch.device("cpu"))
    assert batch.completion_ids.shape == (2, 1)
    assert batch.completion_mask.sum() == 0


def test_rows_trim_all_padding_columns(groups):
    batch = collate(groups, PAD, torch.device("cpu"))
    first = batch.rows(0, 2)  # short prompts, longest completion 3
    assert first.prompt_ids.tolist() == [[5, 6], [5, 6]]
    assert first.prompt_mask.tolist() == [[1, 1], [1, 1]]
    assert first.completion_ids.tolist() == [[7, 8, 9], [1, 0, 0]]
    assert first.truncated.tolist() == [True, False]

    second = batch.rows(2, 4)  # long prompts, longest completion 2
    assert second.prompt_ids.tolist() == [[4, 5, 6, 7], [4, 5, 6, 7]]
    assert second.completion_ids.tolist() == [[9, 1], [0, 0]]
    assert second.completion_mask.tolist() == [[1, 1], [0, 0]]
    torch.testing.assert_close(second.sampling_logps, torch.tensor([[-0.1, -0.2], [0.0, 0.0]]))
    assert second.truncated.tolist() == [False, False]

    only_empty = batch.rows(3, 4)
    assert only_empty.completion_ids.shape == (1, 1)
    assert only_empty.completion_mask.tolist() == [[0]]


def test_rows_of_the_whole_batch_change_nothing(groups):
    batch = collate(groups, PAD, torch.device("cpu"))
    whole = batch.rows(0, len(batch))
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_logps"):
        assert torch.equal(getattr(whole, name), getattr(batch, name)), name


def test_rows_cut_by_the_whole_batchs_extents_equal_rows_cut_by_their_own(groups):
    """`micro_batches` reads every row's extents in one copy; the cuts are the same."""
    batch = collate(groups, PAD, torch.device("cpu"))
    extents = batch.row_extents()
    assert extents == ([2, 2, 0, 0], [3, 1, 2, 0])
    for start, stop in ((0, 2), (1, 3), (2, 4), (3, 4), (0, 4)):
        own, shared = batch.rows(start, stop), batch.rows(start, stop, extents)
        assert own.left_padded == shared.left_padded
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "loss_mask"):
            assert torch.equal(getattr(own, name), getattr(shared, name)), (start, stop, name)


def test_reward_inputs_repeat_prompts_and_columns_per_completion():
    groups = [
        group([1], [completion([2]), completion([3])], prompt="a", columns={"answer": "1", "level": 1}),
        group([1], [completion([4]), completion([5])], prompt="b", columns={"answer": "2", "extra": "x"}),
    ]
    prompts, completions, completion_ids, columns = reward_inputs(groups)
    assert prompts == ["a", "a", "b", "b"]
    assert completions == ["t[2]", "t[3]", "t[4]", "t[5]"]
    assert completion_ids == [[2], [3], [4], [5]]
    assert columns == {
        "answer": ["1", "1", "2", "2"],
        "level": [1, 1, None, None],  # a column missing from a row reads as None
        "extra": [None, None, "x", "x"],
    }


def test_reward_inputs_for_conversational_prompts():
    messages = [{"role": "user", "content": "hi"}]
    groups = [group([1], [completion([2]), completion([3])], prompt=messages, columns={"solution": "yo"})]
    prompts, completions, _, columns = reward_inputs(groups)
    assert prompts == [messages, messages]
    assert completions == [
        [{"role": "assistant", "content": "t[2]"}],
        [{"role": "assistant", "content": "t[3]"}],
    ]
    assert columns == {"solution": ["yo", "yo"]}


class FakeEngine:
    """Returns fixed completions and records what it was asked for."""

    capabilities = EngineCapabilities(name="fake")
    shares_policy_weights, policy_version, stats = True, 0, EngineStats()

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append(([list(prompt) for prompt in prompts], params))
        return [[completion([prompt[-1] + index + 1, 1]) for index in range(params.n)] for prompt in prompts]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(token) for token in ids if not (skip_special_tokens and token == 1))


def test_generate_groups_pairs_items_with_their_completions():
    items = [PromptItem(prompt="x", prompt_ids=[3]), PromptItem(prompt="y", prompt_ids=[5, 10])]
    engine = FakeEngine()
    params = SamplingParams(n=2, max_tokens=4)
    groups = generate_groups(engine, FakeTokenizer(), items, params)
    assert engine.calls == [([[3], [5, 10]], params)]
    assert [g.item for g in groups] == items
    assert [[c.token_ids for c in g.completions] for g in groups] == [[[4, 1], [5, 1]], [[11, 1], [12, 1]]]
    assert [g.texts for g in groups] == [["4", "5"], ["11", "12"]]  # special tokens skipped


def test_left_padding_is_recorded_for_the_batch_and_its_rows():
    same = [
        Group(
            item=PromptItem(prompt="ab", prompt_ids=[1, 2]),
            completions=[Completion([3], [0.0], "stop")] * 2,
            texts=["c", "c"],
        )
    ]
    assert not collate(same, 0, torch.device("cpu")).left_padded
    mixed = same + [
        Group(
            item=PromptItem(prompt="a", prompt_ids=[1]),
            completions=[Completion([3], [0.0], "stop")] * 2,
            texts=["c", "c"],
        )
    ]
    batch = collate(mixed, 0, torch.device("cpu"))
    assert batch.left_padded
    assert not batch.rows(0, 2).left_padded and batch.rows(1, 3).left_padded
    assert not batch.rows(2, 4).left_padded  # one prompt length: the padding column is cut away


def test_single_turn_logs_the_engines_prefill_and_prefix_cache_counts():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(len(tokenizer), seed=0)
    engine = NativeEngine(model, config=NativeEngineConfig(block_size=4, max_num_seqs=4, max_model_len=64))
    text = "a prompt of 21 chars."
    items = [PromptItem(text, tokenizer.encode(text), {})]
    rollout = SingleTurn(tokenizer)
    params = SamplingParams(n=2, max_tokens=3, temperature=0)
    rollout(engine, items, params)
    length = len(items[0].prompt_ids)
    assert rollout.last_metrics == {
        "rollout/prefill_tokens": float(length),
        "rollout/prefix_cache_hit_tokens": 0.0,
        "rollout/prefix_cache_hit_rate": 0.0,
    }
    rollout(engine, items, params)  # the same prompt again: all its full blocks but the last token's
    cached = (length - 1) // 4 * 4
    assert rollout.last_metrics["rollout/prefix_cache_hit_tokens"] == cached > 0
    assert rollout.last_metrics["rollout/prefill_tokens"] == length - cached
    assert rollout.last_metrics["rollout/prefix_cache_hit_rate"] == pytest.approx(cached / length)


class CountingTokenizer:
    """The char tokenizer, counting the decodes asked of it."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decodes = tokenizer, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decodes += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_the_native_engines_texts_are_taken_unless_a_stop_string_cut_them():
    # The engine decodes each completion with the run's tokenizer already: the groups take its
    # texts. Cut at a stop string they are not the decode of the token ids, which the groups keep
    # (as TRL's texts are, the stop string's tokens included).
    tokenizer = build_char_tokenizer()
    engine = NativeEngine(
        build_tiny_model(len(tokenizer), seed=0),
        config=NativeEngineConfig(block_size=4, max_num_seqs=8, max_model_len=64),
        tokenizer=tokenizer,
    )
    assert engine.capabilities.decodes_texts
    items = [PromptItem(text, tokenizer.encode(text), {}) for text in ("first prompt", "second")]
    counting = CountingTokenizer(tokenizer)
    groups = generate_groups(engine, counting, items, SamplingParams(n=2, max_tokens=12, seed=3))
    assert counting.decodes == 0
    for group in groups:
        assert group.texts == [
            tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group.completions
        ]
    stop = groups[0].texts[0][2:4]  # drawn with the same seed again: the text holds it
    cut = generate_groups(
        engine, counting, items[:1], SamplingParams(n=2, max_tokens=12, seed=3, stop=[stop])
    )
    assert counting.decodes == 2
    first = cut[0].completions[0]
    assert cut[0].texts[0] == tokenizer.decode(first.token_ids, skip_special_tokens=True)
    assert stop in cut[0].texts[0] and stop not in first.text
