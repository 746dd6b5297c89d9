import asyncio
import json
import time

import pytest

from grpoflow.agents.tools import ToolBox, environment_tools, resolve_tools, tool_schema
from grpoflow.chat.tool_calls import MalformedToolCall, ToolCall
from grpoflow.threads import DaemonPool


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


async def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: What to shout.
    """
    return text.upper()


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


def broken() -> str:
    """Always fails."""
    raise RuntimeError("disk full")


def undocumented(x):
    return x


def call(box, name, **arguments):
    return asyncio.run(box.call(ToolCall(name, arguments)))


@pytest.fixture
def box():
    return ToolBox([add, shout, slow, broken], timeout=0.5, workers=DaemonPool(4, "test-tools"))


def test_sync_and_async_tools_answer(box):
    assert call(box, "add", a=2, b=3).content == "5"
    assert call(box, "shout", text="hi").content == "HI"


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("nope", {}, "tool 'nope' does not exist; the tools are: add, shout, slow, broken"),
        ("add", {"a": 1}, "bad arguments for 'add'"),
        ("broken", {}, "RuntimeError: disk full"),
        ("slow", {"seconds": 5}, "did not answer within 0.5 s"),
    ],
)
def test_every_failure_is_an_error_message_for_the_model(box, name, arguments, message):
    result = call(box, name, **arguments)
    assert result.error and message in json.loads(result.content)["error"]


def test_a_malformed_call_is_answered_with_its_problem(box):
    result = asyncio.run(box.call(MalformedToolCall("{x", "the tool call is not valid JSON")))
    assert result.error and "not valid JSON" in result.content


def test_schemas_come_from_type_hints_and_docstrings(box):
    schema = tool_schema(add)
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["properties"]["a"] == {
        "type": "integer",
        "description": "The first.",
    }
    with pytest.raises(ValueError, match="tool 'undocumented' cannot be described .* Google-style docstring"):
        tool_schema(undocumented)


def test_tools_resolve_from_import_paths(tmp_path):
    path = tmp_path / "mytools.py"
    path.write_text(
        'def double(x: int) -> int:\n    """Double.\n\n    Args:\n        x: A number.\n    """\n    return 2 * x\n'
    )
    (double,) = resolve_tools([f"{path}:double"])
    assert double(4) == 8
    with pytest.raises(ValueError, match="has no attribute 'triple'"):
        resolve_tools([f"{path}:triple"])


def test_an_environments_tools_are_its_public_methods_but_not_its_hooks():
    class Game:
        def reset(self, **row):
            return None

        def get_reward(self):
            return 1.0

        def respond(self, text):
            return None

        def _helper(self):
            return None

        def move(self, direction: str) -> str:
            """Move.

            Args:
                direction: Where.
            """
            return direction

    assert [tool.__name__ for tool in environment_tools(Game())] == ["move"]
