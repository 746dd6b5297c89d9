"""Tool calls in chat answers: the response built from a fixed text, read back by the `openai`
client's own types (a random model writes no call, so the server test cannot show one)."""

from __future__ import annotations

import json

import pytest

from grpoflow.engines.base import Completion
from grpoflow.policy.tiny import build_char_tokenizer
from grpoflow.server.protocol import ChatCompletionRequest
from grpoflow.server.responses import chat_response

chat = pytest.importorskip("openai.types.chat")

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
HERMES = (
    "<think>\nadd them\n</think>\n\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": {"c": "</tool_call>"}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
LLAMA = '<|python_tag|>{"name": "add", "parameters": {"a": 2}}; {"name": "now", "parameters": {}}'


def answer(texts: list[str], parser: str = "auto", **request) -> chat.ChatCompletion:
    """The chat response to `request` whose completions wrote `texts`, as the openai client reads it."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "2+3?"}], **request)
    group = [Completion([5, 6, 1], [-0.1, -0.2, -0.3], "stop", text=text) for text in texts]
    response = chat_response(body, "tiny", [3, 4], group, build_char_tokenizer(), parser)
    json.dumps(response)  # what the server sends must be JSON
    return chat.ChatCompletion.model_validate(response)


def calls_of(choice) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls]


@pytest.mark.parametrize("parser", ["hermes", "auto"])
def test_hermes_calls_are_openai_tool_calls(parser):
    (choice,) = answer([HERMES], parser, tools=TOOLS).choices
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice) == [("add", {"a": 2, "b": {"c": "</tool_call>"}}), ("now", {})]
    assert choice.message.content == "<think>\nadd them\n</think>"
    ids = [call.id for call in choice.message.tool_calls]
    assert all(call.type == "function" for call in choice.message.tool_calls)
    assert all(name.startswith("call_") for name in ids) and len(set(ids)) == 2


@pytest.mark.parametrize("parser", ["llama3_json", "auto"])
def test_llama3_json_calls_are_openai_tool_calls_with_no_content(parser):
    (choice,) = answer([LLAMA], parser, tools=TOOLS).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls_of(choice) == [("add", {"a": 2}), ("now", {})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{bad json}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 1}}',
        '<tool_call>{"arguments": {}}</tool_call>',
        '{"name": "add", "parameters": [1]}',
    ],
)
def test_a_text_with_a_malformed_call_is_answered_as_content_whole(text):
    (choice,) = answer([text], tools=TOOLS).choices
    assert choice.message.content == text and choice.message.tool_calls == []
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize(
    "request_options",
    [{}, {"tools": []}, {"tools": TOOLS, "tool_choice": "none"}],
)
def test_no_calls_are_read_without_tools_on_offer(request_options):
    (choice,) = answer([HERMES], **request_options).choices
    assert choice.message.content == HERMES and choice.message.tool_calls == []
    assert choice.finish_reason == "stop"


def test_the_format_decides_and_each_choice_is_read_on_its_own():
    hermes_only = answer([LLAMA, HERMES, "4"], "hermes", tools=TOOLS).choices
    assert [choice.finish_reason for choice in hermes_only] == ["stop", "tool_calls", "stop"]
    assert hermes_only[0].message.content == LLAMA and hermes_only[2].message.content == "4"
    assert [name for name, _ in calls_of(hermes_only[1])] == ["add", "now"]
