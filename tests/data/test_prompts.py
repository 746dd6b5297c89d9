import json
import logging

import pytest

from grpoflow.data.prompts import (
    PromptSampler,
    build_prompt_items,
    encode_prompt,
    load_rows,
    read_system_prompt,
)
from grpoflow.policy.tiny import build_char_tokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""A small chat template the character tokenizer can encode (lowercase, `<`, `>`, newline)."""

ROWS = [
    {"prompt": "add 1 and 2", "answer": "3", "level": 1},
    {"prompt": "add 2 and 2", "answer": "4", "level": 2},
    {"prompt": "add 3 and 2", "answer": "5", "level": 3},
]


@pytest.fixture(scope="module")
def tokenizer():
    """The character tokenizer without its chat template: a base model's."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


@pytest.fixture
def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def items_of(rows, tokenizer, *, system=None, max_prompt_length=512, truncation_strategy="delete"):
    return build_prompt_items(
        rows,
        tokenizer,
        system=system,
        max_prompt_length=max_prompt_length,
        truncation_strategy=truncation_strategy,
    )


# load_rows: packaged tasks


def test_echo_task_splits():
    train, test = load_rows("echo"), load_rows("echo", split="test")
    assert len(train) == 4096 and len(test) == 256
    assert train[0]["prompt"] == f"echo {train[0]['letter']}:"
    assert load_rows("echo") == train  # the task is deterministic
    with pytest.raises(ValueError, match="echo has splits train, test"):
        load_rows("echo", split="validation")


@pytest.mark.parametrize("split", ["train", "test"])
def test_gsm8k_task(split):
    rows = load_rows("gsm8k", split=split)
    assert len(rows) > 1000
    assert {"question", "answer"} <= set(rows[0])
    assert "####" in rows[0]["answer"]


def test_gsm8k_unknown_split():
    with pytest.raises(ValueError, match="gsm8k has splits train and test"):
        load_rows("gsm8k", split="dev")


# load_rows: local files


def test_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS[:2]) + "\n\n" + json.dumps(ROWS[2]) + "\n")
    assert load_rows(str(path)) == ROWS


def test_json_list(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS))
    assert load_rows(str(path)) == ROWS


def test_json_must_be_a_list(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(ValueError, match="must hold a JSON list of rows"):
        load_rows(str(path))


def test_csv(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("prompt,answer\nadd 1 and 2,3\nadd 2 and 2,4\n")
    rows = load_rows(str(path))
    assert [row["prompt"] for row in rows] == ["add 1 and 2", "add 2 and 2"]
    assert [str(row["answer"]) for row in rows] == ["3", "4"]


def test_parquet(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "rows.parquet"
    parquet.write_table(pyarrow.Table.from_pylist(ROWS), path)
    assert load_rows(str(path)) == ROWS


def test_invalid_json_line_names_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + "{not json\n")
    with pytest.raises(ValueError, match=r"rows.jsonl:2 is not valid JSON"):
        load_rows(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(str(tmp_path / "missing.jsonl"))


def test_unsupported_extension(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text("add 1 and 2\n")
    with pytest.raises(ValueError, match=r"use a \.jsonl, \.json, \.parquet or \.csv file"):
        load_rows(str(path))


def test_empty_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        load_rows(str(path))


# load_rows: `#N` subsampling


def test_subsample_is_deterministic_for_a_seed():
    first = load_rows("echo#10", seed=1)
    assert len(first) == 10
    assert load_rows("echo#10", seed=1) == first
    assert load_rows("echo#10", seed=2) != first
    assert all(row in load_rows("echo") for row in first)


def test_subsample_larger_than_the_dataset_keeps_all(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS))
    assert load_rows(f"{path}#3") == ROWS
    assert load_rows(f"{path}#100") == ROWS
    assert len(load_rows(f"{path}#2")) == 2


@pytest.mark.parametrize("suffix", ["0", "-1", "ten", "1.5", ""])
def test_bad_count_suffix(suffix):
    with pytest.raises(ValueError, match="the part after '#' must be a positive row count"):
        load_rows(f"echo#{suffix}")


# system prompts


def test_system_prompt_text_or_file(tmp_path):
    path = tmp_path / "system.txt"
    path.write_text("be brief\n")
    assert read_system_prompt(str(path)) == "be brief"
    assert read_system_prompt("be brief") == "be brief"
    assert read_system_prompt(None) is None


@pytest.mark.parametrize(
    "text",
    ["think step by step " * 40, "a\x00b"],  # no file system takes these as names
    ids=["longer-than-a-file-name", "nul-byte"],
)
def test_system_prompt_text_that_cannot_be_a_path(text):
    assert read_system_prompt(text) == text


# build_prompt_items: prompt columns


@pytest.mark.parametrize("column", ["prompt", "problem", "question"])
def test_prompt_columns(tokenizer, column):
    rows = [{column: "what is 1+1?", "answer": "2"}]
    (item,) = items_of(rows, tokenizer)
    assert item.prompt == "what is 1+1?"
    assert item.prompt_ids == ids_of(tokenizer, "what is 1+1?")
    assert item.columns == {"answer": "2"}


def test_first_prompt_column_wins_and_others_are_carried(tokenizer):
    rows = [{"question": "q", "prompt": "p", "problem": "", "level": 3, "tags": ["a"]}]
    (item,) = items_of(rows, tokenizer)
    assert item.prompt == "p"
    assert item.columns == {"question": "q", "problem": "", "level": 3, "tags": ["a"]}


def test_conversational_row_moves_the_assistant_turn_to_solution(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 1+1?"},
        {"role": "assistant", "content": "2"},
    ]
    (item,) = items_of([{"messages": messages, "level": 1}], tokenizer)
    assert item.prompt == messages[:2]
    assert item.columns == {"solution": "2", "level": 1}
    # without a chat template the messages become "role: content" lines
    assert item.prompt_ids == ids_of(tokenizer, "system: be brief\nuser: what is 1+1?")


def test_the_tiny_models_template_keeps_a_text_prompt_as_it_is():
    tokenizer = build_char_tokenizer()
    assert tokenizer.chat_template
    for prompt, system in (("echo c:", None), ("echo c:", "be brief")):
        expected = ids_of(tokenizer, f"{system}\n{prompt}" if system else prompt)
        assert encode_prompt(tokenizer, prompt, system) == expected


def test_conversational_row_keeps_an_existing_solution(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (item,) = items_of([{"messages": messages, "solution": "given"}], tokenizer)
    assert item.columns == {"solution": "given"}
    assert item.prompt == messages[:1]


def test_conversation_ending_with_a_user_turn_is_kept_whole(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    (item,) = items_of([{"messages": messages}], tokenizer)
    assert item.prompt == messages
    assert item.columns == {}


def test_system_prompt_without_chat_template(tokenizer):
    (item,) = items_of([{"prompt": "hi"}], tokenizer, system="be brief")
    assert item.prompt_ids == ids_of(tokenizer, "be brief\nhi")
    assert item.prompt == "hi"  # rewards see the user's prompt


def test_system_prompt_from_a_file(tokenizer, tmp_path):
    path = tmp_path / "system.txt"
    path.write_text("be brief\n")
    (item,) = items_of([{"prompt": "hi"}], tokenizer, system=read_system_prompt(str(path)))
    assert item.prompt_ids == ids_of(tokenizer, "be brief\nhi")


def test_chat_template_applies_with_generation_prompt(chat_tokenizer):
    (item,) = items_of([{"prompt": "hi"}], chat_tokenizer)
    assert item.prompt_ids == ids_of(chat_tokenizer, "<user>hi\n<assistant>")
    (item,) = items_of([{"prompt": "hi"}], chat_tokenizer, system="be brief")
    assert item.prompt_ids == ids_of(chat_tokenizer, "<system>be brief\n<user>hi\n<assistant>")


def test_chat_template_keeps_the_rows_own_system_message(chat_tokenizer):
    messages = [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}]
    ids = encode_prompt(chat_tokenizer, messages, system="ignored")
    assert ids == ids_of(chat_tokenizer, "<system>own\n<user>hi\n<assistant>")


def test_a_recurring_text_prompt_is_tokenized_once_and_each_item_has_its_own_ids(chat_tokenizer):
    calls = []
    render = chat_tokenizer.apply_chat_template
    chat_tokenizer.apply_chat_template = lambda messages, **kwargs: (
        calls.append(1) or render(messages, **kwargs)
    )
    rows = [{"prompt": "hi", "n": n} for n in range(50)] + [{"prompt": "yo"}]
    items = items_of(rows, chat_tokenizer)
    assert len(calls) == 2
    assert [item.prompt_ids for item in items] == [ids_of(chat_tokenizer, "<user>hi\n<assistant>")] * 50 + [
        ids_of(chat_tokenizer, "<user>yo\n<assistant>")
    ]
    assert items[0].prompt_ids is not items[1].prompt_ids
    assert [item.columns for item in items[:2]] == [{"n": 0}, {"n": 1}]


# build_prompt_items: over-long prompts


LENGTHS = [{"prompt": "ab"}, {"prompt": "abcdefgh"}, {"prompt": "abc"}]


def test_delete_skips_long_prompts_and_reports_them(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="grpoflow.data.prompts"):
        items = items_of(LENGTHS, tokenizer, max_prompt_length=4, truncation_strategy="delete")
    assert [item.prompt for item in items] == ["ab", "abc"]
    assert "skipped 1 of 3 rows" in caplog.text
    assert "row 1: prompt of 8 tokens > max_prompt_length" in caplog.text


def test_left_keeps_the_last_tokens(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="grpoflow.data.prompts"):
        items = items_of(LENGTHS, tokenizer, max_prompt_length=4, truncation_strategy="left")
    assert [item.prompt_ids for item in items] == [
        ids_of(tokenizer, "ab"),
        ids_of(tokenizer, "efgh"),
        ids_of(tokenizer, "abc"),
    ]
    assert items[1].prompt == "abcdefgh"
    assert "truncated 1 prompts on the left to 4 tokens" in caplog.text


def test_raise_on_a_long_prompt(tokenizer):
    with pytest.raises(ValueError, match="row 1: prompt has 8 tokens > max_prompt_length=4"):
        items_of(LENGTHS, tokenizer, max_prompt_length=4, truncation_strategy="raise")


def test_prompt_of_exactly_the_limit_is_kept(tokenizer):
    items = items_of(LENGTHS, tokenizer, max_prompt_length=8, truncation_strategy="raise")
    assert len(items) == 3


# build_prompt_items: bad rows


def test_rows_without_a_prompt_are_reported(tokenizer, caplog):
    rows = [
        {"prompt": "ok"},
        {"text": "no prompt column"},
        {"prompt": ""},
        {"prompt": 5},
        {"messages": [{"role": "assistant", "content": "only an answer"}]},
        {"messages": [{"content": "no role"}]},
        "not a mapping",
    ]
    with caplog.at_level(logging.WARNING, logger="grpoflow.data.prompts"):
        items = items_of(rows, tokenizer)
    assert [item.prompt for item in items] == ["ok"]
    assert "skipped 6 of 7 rows" in caplog.text
    assert "row 1: no prompt: a row needs one of the columns prompt, problem, question, messages" in (
        caplog.text
    )
    assert "(found text)" in caplog.text
    assert " ..." in caplog.text  # only the first five problems are spelled out


def test_all_bad_rows_raise(tokenizer):
    with pytest.raises(ValueError, match=r"no usable prompts among 2 rows \(first problem: row 0: no prompt"):
        items_of([{"text": "a"}, {"text": "b"}], tokenizer)
    with pytest.raises(ValueError, match="no usable prompts among 1 rows"):
        items_of([{"prompt": "abcdef"}], tokenizer, max_prompt_length=2)


# PromptSampler


def draw(sampler: PromptSampler, counts) -> list[list[int]]:
    return [sampler.take(count) for count in counts]


def test_each_epoch_is_a_permutation():
    sampler = PromptSampler(10, seed=0)
    first, second = sampler.take(10), sampler.take(10)
    assert sorted(first) == list(range(10))
    assert sorted(second) == list(range(10))
    assert first != second
    assert sampler.state_dict() == {"epoch": 1, "position": 10}


def test_takes_cross_epoch_boundaries():
    sampler = PromptSampler(5, seed=3)
    taken = [index for batch in draw(sampler, [3, 3, 3, 1]) for index in batch]
    assert sorted(taken[:5]) == list(range(5))
    assert sorted(taken[5:]) == list(range(5))
    assert sampler.state_dict() == {"epoch": 1, "position": 5}


def test_orders_depend_on_the_seed():
    assert PromptSampler(50, seed=0).take(50) != PromptSampler(50, seed=1).take(50)
    assert PromptSampler(50, seed=0).take(50) == PromptSampler(50, seed=0).take(50)


def test_no_shuffle_keeps_row_order():
    assert PromptSampler(4, seed=0, shuffle=False).take(6) == [0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize("taken_before", [0, 3, 7, 10, 23])
def test_state_dict_resumes_the_same_sequence(taken_before):
    uninterrupted = PromptSampler(7, seed=5)
    uninterrupted.take(taken_before)
    expected = draw(uninterrupted, [4, 4, 4, 4])

    original = PromptSampler(7, seed=5)
    original.take(taken_before)
    state = json.loads(json.dumps(original.state_dict()))  # survives serialisation
    resumed = PromptSampler(7, seed=5)
    resumed.load_state_dict(state)
    assert draw(resumed, [4, 4, 4, 4]) == expected


def test_a_misspelled_task_name_is_named_at_once():
    with pytest.raises(ValueError, match="did you mean 'gsm8k'"):
        load_rows("gsm8kk")


def test_an_unreachable_hub_fails_at_once(monkeypatch):
    from helpers.support import free_port

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(
        ValueError, match=r"the hub \(http://127.0.0.1:\d+\) cannot be reached .* HF_HUB_OFFLINE=1"
    ):
        load_rows("someone/no-such-dataset")
