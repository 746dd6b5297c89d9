"""A function whose global names resolve to given values: a module's forward that looks up a
replaced function (a rotary kernel, say) without the replacement reaching its modeling module."""

from __future__ import annotations

import types


def with_globals(function: types.FunctionType, overrides: dict[str, object]) -> types.FunctionType:
    """A copy of `function` whose global names in `overrides` are theirs (the rest as they are now)."""
    copied = types.FunctionType(
        function.__code__,
        {**function.__globals__, **overrides},
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copied.__kwdefaults__ = function.__kwdefaults__
    copied.__qualname__ = function.__qualname__
    copied.__wrapped__ = function
    return copied
