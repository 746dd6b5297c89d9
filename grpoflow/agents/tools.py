"""Tools an episode may call: plain functions (TRL's `tools`) and an environment's public methods.

Each call runs with a timeout (sync functions in a thread, async ones awaited). Whatever goes
wrong (an unknown tool, bad arguments, an exception, a timeout, a call that could not be read) is
answered to the model as `{"error": "..."}`, TRL's convention, and counted; it never ends the
episode or the step.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from grpoflow import imports
from grpoflow.chat.tool_calls import MalformedToolCall, ToolCall

HOOKS = frozenset({"reset", "get_reward", "respond"})
"""Methods of an environment that are not tools."""


@dataclass(frozen=True, slots=True)
class ToolResult:
    name: str
    content: str
    error: bool


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema a chat template renders for `function` (from its type hints and docstring)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as error:
        name = getattr(function, "__name__", repr(function))
        raise ValueError(
            f"tool {name!r} cannot be described to the model: {error}. A tool needs type hints on every "
            "argument and a Google-style docstring with an Args: section"
        ) from None


def environment_tools(environment: Any) -> list[Callable[..., Any]]:
    """The environment's tools: its public methods other than the hooks (TRL's rule); given its
    class, the class's functions."""
    cls = environment if inspect.isclass(environment) else type(environment)
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in HOOKS and not name.startswith("_")
    ]


def resolve_tools(specs: Sequence[str]) -> list[Callable[..., Any]]:
    """The functions import paths name, each checked to describe itself (see `tool_schema`)."""
    functions = []
    for spec in specs:
        function = imports.load_object(spec, "Tool")
        if not callable(function):
            raise ValueError(f"Tool {spec!r} is a {type(function).__name__}, not a function")
        tool_schema(function)
        functions.append(function)
    return functions


class ToolBox:
    """The tools of one episode, called by name with a timeout; synchronous ones run in
    `workers` (a call still waiting there when the timeout passes never runs)."""

    def __init__(self, functions: Sequence[Callable[..., Any]], timeout: float, workers: Executor) -> None:
        self.functions = {function.__name__: function for function in functions}
        self.timeout, self.workers = timeout, workers

    async def call(self, call: ToolCall | MalformedToolCall) -> ToolResult:
        """Run one call; its result or its error, as the model will read it."""
        if isinstance(call, MalformedToolCall):
            return _error("invalid_tool_call", call.message)
        function = self.functions.get(call.name)
        if function is None:
            known = ", ".join(self.functions) or "none"
            return _error(call.name, f"tool {call.name!r} does not exist; the tools are: {known}")
        try:
            if inspect.iscoroutinefunction(function):
                result = await asyncio.wait_for(function(**call.arguments), self.timeout)
            else:
                running = asyncio.wrap_future(self.workers.submit(function, **call.arguments))
                result = await asyncio.wait_for(running, self.timeout)
        except TimeoutError:
            return _error(call.name, f"tool {call.name!r} did not answer within {self.timeout:g} s")
        except TypeError as error:
            return _error(call.name, f"bad arguments for {call.name!r}: {error}")
        except Exception as error:
            return _error(call.name, f"{type(error).__name__}: {error}")
        return ToolResult(
            call.name, result if isinstance(result, str) else json.dumps(result, default=str), False
        )


def _error(name: str, message: str) -> ToolResult:
    return ToolResult(name, json.dumps({"error": message}), True)
