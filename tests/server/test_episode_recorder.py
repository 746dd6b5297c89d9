"""A black-box agent on the real `openai` client against a real `grpoflow serve` process: its
episode's turns are recorded token-exact and read back over /v1/episodes."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from helpers.agent_programs import TOOLS

from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model
from grpoflow.run.infer_workers import RolloutServers

openai = pytest.importorskip("openai")

QWEN_STYLE_TEMPLATE = (
    r"{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>' }}"
    r"{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    r"""{{- '\n</tools>\nCall one: <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call><|im_end|>\n' }}"""
    r"{%- endif %}"
    r"{%- for m in messages %}"
    r"{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}{%- if m.content %}{{- m.content }}{%- endif %}"
    r"{%- for call in m.tool_calls or [] %}"
    r"""{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}"""
    r"{{- call.function.arguments | tojson }}{{- '}\n</tool_call>' }}"
    r"{%- endfor %}{{- '<|im_end|>\n' }}"
    r"{%- elif m.role == 'tool' %}"
    r"{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    r"{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    r"{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
"""Qwen2.5's layout of tools, tool calls and tool answers, spelled in the character tokenizer."""

QUESTION = {"role": "user", "content": "What is 2 + 3?"}
ARGUMENTS = '{"a": 2, "b": 3}'
MAX_RECORDED = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama and its character tokenizer, which carries QWEN_STYLE_TEMPLATE (not a
    Qwen2: transformers 5 loads a qwen2 directory's tokenizer as Qwen2Tokenizer, which drops the
    character tokenizer's whitespace tokens)."""
    directory = tmp_path_factory.mktemp("qwen-style")
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    tokenizer.save_pretrained(directory)
    build_tiny_model(len(tokenizer), model_type="llama", max_position_embeddings=2048).save_pretrained(
        directory
    )
    return directory


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    flags = ["--model", str(model_dir), "--max-recorded-episodes", str(MAX_RECORDED)]
    with RolloutServers(flags, [None], tmp_path_factory.mktemp("logs")) as servers:
        servers.wait_until_healthy(120)
        yield servers


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.urls[0]


def agent(url: str, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, **options)


def episode(url: str, episode_id: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/episodes/{episode_id}", timeout=30)


def tool_turn(first_text: str | None) -> list[dict]:
    """The conversation after the agent ran `add` for the model (as an agent loop appends it)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": ARGUMENTS}}
    return [
        QUESTION,
        {"role": "assistant", "content": first_text, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]


def test_two_turns_of_an_agent_episode_are_recorded_token_exact(url, model_dir):
    client = agent(url, default_headers={"X-Episode-Id": "ep-1"})
    model = client.models.list().data[0].id
    first = client.chat.completions.create(
        model=model, messages=[QUESTION], tools=TOOLS, max_tokens=12, seed=1
    )
    second = client.chat.completions.create(
        model=model, messages=tool_turn(first.choices[0].message.content), tools=TOOLS, max_tokens=12
    )

    recorded = episode(url, "ep-1").json()
    assert recorded["id"] == "ep-1" and recorded["object"] == "episode" and recorded["num_turns"] == 2
    turn_1, turn_2 = recorded["turns"]
    assert turn_2["prompt_ids"][: len(turn_1["prompt_ids"])] == turn_1["prompt_ids"]
    assert len(turn_2["prompt_ids"]) > len(turn_1["prompt_ids"])
    for turn, answer in ((turn_1, first), (turn_2, second)):
        assert turn["response_id"] == answer.id
        assert len(turn["completion_ids"]) == len(turn["completion_logprobs"])
        assert len(turn["completion_ids"]) == answer.usage.completion_tokens >= 1
        assert len(turn["prompt_ids"]) == answer.usage.prompt_tokens
        assert all(value <= 0 for value in turn["completion_logprobs"])
        assert turn["finish_reason"] == answer.choices[0].finish_reason
        assert turn["message"]["content"] == answer.choices[0].message.content
        assert turn["tools"] == TOOLS and turn["policy_version"] == 0
        assert turn["sampling"] == {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0
        }  # fmt: skip
    assert turn_1["messages"] == [QUESTION]
    assert turn_2["messages"][1]["tool_calls"][0]["function"]["arguments"] == ARGUMENTS

    rendered = _rendered(turn_2["messages"])
    assert '"name": "add"' in rendered and '"required": ["a", "b"]' in rendered  # the tools
    assert '{"name": "add", "arguments": {"a": 2, "b": 3}}' in rendered  # arguments decoded for the template
    assert "<tool_response>\n5\n</tool_response>" in rendered
    assert turn_2["prompt_ids"] == build_char_tokenizer()(rendered, add_special_tokens=False)["input_ids"]
    _assert_logprobs_are_the_models(model_dir, turn_2)


def _rendered(messages: list[dict]) -> str:
    """The conversation as the template renders it given the arguments as objects."""
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    tokenizer = build_char_tokenizer()
    return tokenizer.apply_chat_template(
        messages, tools=TOOLS, chat_template=QWEN_STYLE_TEMPLATE, tokenize=False, add_generation_prompt=True
    )


def _assert_logprobs_are_the_models(model_dir, turn: dict) -> None:
    """The recorded log-probs are log_softmax of the served model's logits (temperature 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt, completion = turn["prompt_ids"], turn["completion_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(turn["completion_logprobs"]), expected, atol=1e-4, rtol=1e-4)


def test_the_episode_id_travels_in_the_body_too_and_must_agree_with_the_header(url):
    client = agent(url)
    client.chat.completions.create(
        messages=[QUESTION], model="", max_tokens=3, extra_body={"episode_id": "ep-body"}
    )
    client.chat.completions.create(
        messages=[QUESTION],
        model="",
        max_tokens=3,
        extra_body={"episode_id": "ep-body"},
        extra_headers={"X-Episode-Id": "ep-body"},
    )
    assert episode(url, "ep-body").json()["num_turns"] == 2
    with pytest.raises(openai.BadRequestError, match="differ"):
        client.chat.completions.create(
            messages=[QUESTION],
            model="",
            max_tokens=3,
            extra_body={"episode_id": "ep-body"},
            extra_headers={"X-Episode-Id": "ep-other"},
        )


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"extra_body": {"episode_id": "a/b"}}, "must be 1 to 256 letters"),
        ({"extra_body": {"episode_id": ""}}, "must be 1 to 256 letters"),
        ({"extra_body": {"episode_id": "ep-n"}, "n": 2}, "send n=1"),
        ({"tools": TOOLS, "tool_choice": "required"}, "cannot force a tool call"),
    ],
)
def test_requests_an_episode_cannot_record_are_refused(url, options, words):
    with pytest.raises(openai.BadRequestError, match=words):
        agent(url).chat.completions.create(messages=[QUESTION], model="", max_tokens=3, **options)


def test_unrecorded_requests_add_nothing_and_deleted_episodes_are_gone(url):
    client = agent(url)
    before = httpx.get(f"{url}/v1/episodes").json()["data"]
    answer = client.chat.completions.create(messages=[QUESTION], model="", max_tokens=3, tools=TOOLS)
    assert answer.choices[0].message.tool_calls == []  # a random model writes no call (vLLM: [])
    assert httpx.get(f"{url}/v1/episodes").json()["data"] == before

    agent(url, default_headers={"X-Episode-Id": "ep-gone"}).chat.completions.create(
        messages=[QUESTION], model="", max_tokens=3
    )
    assert {"id": "ep-gone", "num_turns": 1} in httpx.get(f"{url}/v1/episodes").json()["data"]
    deleted = httpx.delete(f"{url}/v1/episodes/ep-gone")
    assert deleted.json() == {"id": "ep-gone", "object": "episode", "deleted": True}
    for answer in (episode(url, "ep-gone"), httpx.delete(f"{url}/v1/episodes/ep-gone")):
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert "'ep-gone'" in error["message"] and error["param"] == "episode_id"


def test_past_max_recorded_episodes_the_least_recently_recorded_is_dropped(url, server):
    for name in ("old", "mid", "new", "newest"):
        agent(url, default_headers={"X-Episode-Id": f"ep-{name}"}).chat.completions.create(
            messages=[QUESTION], model="", max_tokens=2
        )
    recorded = [item["id"] for item in httpx.get(f"{url}/v1/episodes").json()["data"]]
    assert recorded == ["ep-mid", "ep-new", "ep-newest"] and len(recorded) == MAX_RECORDED
    assert episode(url, "ep-old").status_code == 404
    assert "dropped episode 'ep-old'" in server.log_tail(0, 20000)
    info = httpx.get(f"{url}/server_info").json()["grpoflow"]["episodes"]
    assert info["max_recorded"] == MAX_RECORDED and info["num_dropped"] >= 1


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tool-call-parser", "mistral_v9"], "--tool-call-parser must be one of hermes, qwen3_coder, "),
        (["--max-recorded-episodes", "0"], "--max-recorded-episodes must be >= 1"),
    ],
)
def test_the_serve_command_refuses_bad_agent_settings(flags, words, capsys):
    from grpoflow import cli

    assert cli.main(["serve", "--model", "tiny", *flags]) == 2
    assert words in capsys.readouterr().err
