"""A calculator tool for math word problems (GSM8K with `--tools grpoflow.tasks.calculator:calculate`).

`calculate` evaluates arithmetic the model writes, safely: the expression is parsed with `ast`
and only numbers, parentheses, unary signs and + - * / // % ** are evaluated; names, calls,
attributes, subscripts and everything else are refused. Exponents and results are bounded so no
expression can take long or hold much memory. Whatever goes wrong comes back as text beginning
with `Error:`, which the model reads in the tool's reply.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_LENGTH = 200
"""Longest expression evaluated, in characters (bounds parsing time and nesting)."""
MAX_EXPONENT = 64
"""Largest absolute exponent of `**`."""
MAX_MAGNITUDE = 10**15
"""Largest absolute value of any number in or out of an evaluation."""

BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculationError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses, e.g. "(12 + 3) * 4 / 5".

    Returns:
        The value as text, or a message starting with "Error:" saying what could not be evaluated.
    """
    try:
        return format_number(evaluate(expression))
    except CalculationError as error:
        return f"Error: {error}"


def evaluate(expression: str) -> int | float:
    """The value of `expression`; CalculationError when it is not bounded arithmetic.

    >>> evaluate("(12 + 3) * 4 / 5")
    12.0
    """
    if not isinstance(expression, str):
        raise CalculationError(f"the expression must be text, got {type(expression).__name__}")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/").replace(",", "")
    if not text:
        raise CalculationError("the expression is empty")
    if len(text) > MAX_EXPRESSION_LENGTH:
        raise CalculationError(f"the expression is longer than {MAX_EXPRESSION_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculationError(f"{expression!r} is not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalculationError(f"{value!r} is not a number")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculationError("division by zero") from None
        except (OverflowError, ValueError) as error:
            raise CalculationError(str(error)) from None
    raise CalculationError(
        f"{ast.unparse(node)!r} is not allowed: only numbers, parentheses and + - * / // % ** are"
    )


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculationError(f"exponents are limited to {MAX_EXPONENT} in absolute value")
    if base == 0 and exponent < 0:
        raise CalculationError("division by zero")
    if base < 0 and not float(exponent).is_integer():
        raise CalculationError("a negative number to a fractional power is not a real number")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalculationError(f"the result would exceed {MAX_MAGNITUDE:.0e}")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalculationError(f"numbers are limited to {MAX_MAGNITUDE:.0e} in absolute value")
    return value


def format_number(value: int | float) -> str:
    """A value as the model should read it: integers without a decimal point, others to 10
    significant digits.

    >>> format_number(12.0), format_number(2 / 3), format_number(7)
    ('12', '0.6666666667', '7')
    """
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"
