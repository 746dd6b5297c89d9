"""The calculator tool: arithmetic evaluated exactly, and every unsafe or unbounded input refused
with a message the model reads."""

from __future__ import annotations

import re

import pytest

from grpoflow.agents.tools import tool_schema
from grpoflow.tasks.calculator import calculate, evaluate


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3 * 4", "14"),
        ("(12 + 3) * 4 / 5", "12"),
        ("7 // 2", "3"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ^ 3", "8"),
        ("-(3 - 10)", "7"),
        ("1,250 * 4", "5000"),
        ("10 / 4", "2.5"),
        ("2 / 3", "0.6666666667"),
        ("1.5e3 + 0.5", "1500.5"),
    ],
)
def test_arithmetic_is_evaluated(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("9 ** 9 ** 9", "exponents are limited to 64"),
        ("10 ** 64", "the result would exceed"),
        ("2 ** 10 ** 3", "exponents are limited"),
        ("99999999 * 99999999 * 99999999", "numbers are limited to 1e\\+15"),
        ("1e300 * 1e300", "numbers are limited"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("__import__('os').system('echo hi')", "is not allowed"),
        ("().__class__.__mro__", "is not allowed"),
        ("x + 1", "'x' is not allowed"),
        ("abs(-3)", "is not allowed"),
        ("[7][0]", "is not allowed"),
        ("1 if 1 else 2", "is not allowed"),
        ("lambda: 1", "is not allowed"),
        ("'a' * 3", "'a' is not a number"),
        ("True + 1", "True is not a number"),
        ("1 < 2", "is not allowed"),
        ("2 +", "is not an arithmetic expression"),
        ("import os", "is not an arithmetic expression"),
        ("", "empty"),
        ("1" * 500, "longer than 200 characters"),
        ("(" * 150 + "1" + ")" * 150, "longer than 200 characters"),
    ],
)
def test_unsafe_or_unbounded_input_is_refused_as_text(expression, message):
    answer = calculate(expression)
    assert answer.startswith("Error: ")
    assert re.search(message, answer), answer


def test_deep_nesting_within_the_length_limit_is_evaluated_or_refused_never_raised():
    assert calculate("(" * 99 + "1" + ")" * 99) == "1"
    assert calculate("-" * 199 + "1") == "-1"
    assert calculate(12) == "Error: the expression must be text, got int"


def test_its_schema_renders_for_a_chat_template():
    schema = tool_schema(calculate)
    assert schema["function"]["name"] == "calculate"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert "arithmetic" in schema["function"]["description"]
    assert evaluate("3 * (4 + 5)") == 27
