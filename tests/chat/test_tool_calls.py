import pytest

from grpoflow.chat.tool_calls import (
    TOOL_CALL_FORMATS,
    MalformedToolCall,
    ParsedResponse,
    ToolCall,
    parse_tool_calls,
    register_tool_call_format,
)


def named(parsed: ParsedResponse) -> list[tuple[str, dict]]:
    return [(call.name, call.arguments) for call in parsed.calls]


def test_hermes_calls_and_the_content_around_them():
    text = (
        'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": [2, 3]}}}\n</tool_call>'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == "Let me add."
    assert named(parsed) == [("add", {"a": 1, "b": {"c": [2, 3]}}), ("now", {})]
    assert all(c.id.startswith("call_") for c in parsed.calls) and parsed.calls[0].id != parsed.calls[1].id


def test_hermes_keeps_the_text_between_and_after_calls_and_qwen3_thinking():
    text = (
        "<think>\nadd first, then look up\n</think>\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\nand then\n'
        '<tool_call>\n{"name": "find", "arguments": {"q": "x"}}\n</tool_call>\ndone'
    )
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == "<think>\nadd first, then look up\n</think>\n\n\nand then\n\ndone"
    assert named(parsed) == [("add", {"a": 1}), ("find", {"q": "x"})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
        '<tool_call>\r\n  \t{"name":"f","arguments":{"x":1}}  \r\n</tool_call>',
        '  \n<tool_call>\n{\n  "name": "f",\n  "arguments": {\n    "x": 1\n  }\n}\n</tool_call>\n\n',
    ],
)
def test_hermes_whitespace_variants(text):
    parsed = parse_tool_calls(text, "hermes")
    assert named(parsed) == [("f", {"x": 1})] and parsed.content == ""


def test_hermes_close_tag_inside_a_json_string_does_not_end_the_call():
    text = (
        '<tool_call>{"name": "write", "arguments": {"text": "ends with </tool_call> here", '
        '"nested": {"list": [{"deep": "</tool_call>"}]}}}</tool_call> after'
    )
    parsed = parse_tool_calls(text, "hermes")
    assert named(parsed) == [
        ("write", {"text": "ends with </tool_call> here", "nested": {"list": [{"deep": "</tool_call>"}]}})
    ]
    assert parsed.content == "after"


def test_hermes_unicode_and_escapes_in_arguments():
    text = (
        '<tool_call>{"name": "say", "arguments": {"s": "caf\\u00e9 \\"q\\" \\\\ ü", "n": null}}</tool_call>'
    )
    assert named(parse_tool_calls(text)) == [("say", {"s": 'café "q" \\ ü', "n": None})]


def test_llama3_json_calls_with_python_tag_and_semicolons():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": "x;y"}}; {"name": "now", "parameters": {}}'
    parsed = parse_tool_calls(text, "llama3_json")
    assert named(parsed) == [("add", {"a": "x;y"}), ("now", {})] and parsed.content == ""
    assert parse_tool_calls("The answer is 4.", "llama3_json") == ParsedResponse("The answer is 4.", [])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "f", "parameters": {"x": {"y": [1, {"z": "a;b}"}]}}}',
        '  \n<|python_tag|> {"name": "f", "parameters": {"x": {"y": [1, {"z": "a;b}"}]}}} \n',
        '{"name": "f", "arguments": {"x": {"y": [1, {"z": "a;b}"}]}}}',
        '{\n  "name": "f",\n  "parameters": {"x": {"y": [1, {"z": "a;b}"}]}}\n}',
    ],
)
def test_llama3_json_variants_and_nested_arguments(text):
    assert named(parse_tool_calls(text, "llama3_json")) == [("f", {"x": {"y": [1, {"z": "a;b}"}]}})]


def test_llama3_json_three_calls_with_and_without_spaces():
    text = '{"name": "a", "parameters": {}};{"name": "b", "parameters": {"s": "\\";"}} ;  {"name": "c"}'
    assert named(parse_tool_calls(text, "llama3_json")) == [("a", {}), ("b", {"s": '";'}), ("c", {})]


def test_a_python_tag_without_json_is_no_call():
    text = '<|python_tag|>brave_search.call(query="weather")'
    assert parse_tool_calls(text, "llama3_json") == ParsedResponse(text, [])


def test_auto_picks_the_format_and_plain_text_has_no_calls():
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>').calls[0].name == "f"
    assert parse_tool_calls('{"name": "f", "parameters": {"x": 1}}').calls[0].arguments == {"x": 1}
    assert parse_tool_calls("no calls here") == ParsedResponse("no calls here", [])
    assert parse_tool_calls("") == ParsedResponse("", [])


def test_auto_prefers_hermes_when_both_could_read_the_text():
    text = '{"name": "g", "parameters": {}} <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parsed = parse_tool_calls(text)
    assert named(parsed) == [("f", {})] and parsed.content == '{"name": "g", "parameters": {}}'


def test_hermes_ignores_llama3_json_and_llama3_json_ignores_text_before_a_call():
    llama = '{"name": "f", "parameters": {}}'
    assert parse_tool_calls(llama, "hermes") == ParsedResponse(llama, [])
    hermes = 'sure <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_tool_calls(hermes, "llama3_json") == ParsedResponse(hermes, [])


def test_arguments_given_as_a_json_string_are_read():
    (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>').calls
    assert call == ToolCall("f", {"x": 2}, call.id)


def test_missing_arguments_are_empty():
    assert named(parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')) == [("now", {})]


@pytest.mark.parametrize(
    ("text", "raw", "message"),
    [
        ("<tool_call>{not json}</tool_call>", "{not json}", "not valid JSON"),
        ("<tool_call></tool_call>", "", "not valid JSON"),
        ('<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>', None, "not valid JSON"),
        ('<tool_call>["f", {}]</tool_call>', '["f", {}]', "names no tool"),
        ('<tool_call>{"arguments": {}}</tool_call>', None, "names no tool"),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', None, "names no tool"),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', None, "names no tool"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', None, "not a JSON object"),
        ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', None, "not a JSON object"),
        (
            '<tool_call>{"name": "f", "arguments": {}}',
            '<tool_call>{"name": "f", "arguments": {}}',
            "not closed",
        ),
        ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call>', None, "not valid JSON"),
        ('{"name": "f", "parameters": {}', None, "not valid JSON"),
        ('{"name": "f", "parameters": {}} thanks', None, "not valid JSON"),
        ('{"answer": 4}', None, "names no tool"),
        ('{"name": "f", "parameters": 7}', None, "not a JSON object"),
    ],
)
def test_a_malformed_call_becomes_a_message_for_the_model(text, raw, message):
    (call,) = parse_tool_calls(text).calls
    assert isinstance(call, MalformedToolCall) and message in call.message
    assert "write {" in call.message and call.text in text
    if raw is not None:
        assert call.text == raw


def test_malformed_messages_show_the_shape_of_their_format():
    (hermes,) = parse_tool_calls("<tool_call>{x}</tool_call>", "hermes").calls
    (llama,) = parse_tool_calls("{x}", "llama3_json").calls
    assert '"arguments": {...}' in hermes.message and '"parameters": {...}' in llama.message


def test_good_and_malformed_calls_in_one_message_keep_their_order():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> mid '
        "<tool_call>{oops}</tool_call>"
        '<tool_call>{"name": "b", "arguments": {"k": 1}}</tool_call> end <tool_call>{"name": "c"'
    )
    parsed = parse_tool_calls(text, "hermes")
    kinds = [type(call).__name__ for call in parsed.calls]
    assert kinds == ["ToolCall", "MalformedToolCall", "ToolCall", "MalformedToolCall"]
    assert [call.name for call in parsed.calls if isinstance(call, ToolCall)] == ["a", "b"]
    assert parsed.content == "mid  end"
    assert parsed.calls[3].text == '<tool_call>{"name": "c"' and "not closed" in parsed.calls[3].message


def test_a_stray_close_tag_stays_in_the_content():
    text = 'x </tool_call> <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == "x </tool_call>" and named(parsed) == [("f", {})]


def test_a_registered_format_is_used_by_name():
    @register_tool_call_format("test_upper")
    def upper(text, schemas):
        return ParsedResponse("", [ToolCall(text.upper(), {})]) if text else None

    try:
        assert named(parse_tool_calls("go", "test_upper")) == [("GO", {})]
        assert parse_tool_calls("", "test_upper") == ParsedResponse("", [])
    finally:
        del TOOL_CALL_FORMATS["test_upper"]


def test_an_unknown_format_is_named():
    message = "tool_call_parser must be one of hermes, qwen3_coder, llama3_json, deepseek_v3, deepseek_v31, mistral, openai, auto"
    with pytest.raises(ValueError, match=message):
        parse_tool_calls("x", "mistral_v9")
