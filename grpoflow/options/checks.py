"""One way to refuse a bad value: the option's name, what it allows, what it got, and the fix."""

from __future__ import annotations


def require(ok: bool, name: str, allowed: str, value: object, fix: str = "") -> None:
    """Raise ValueError `NAME must be ALLOWED, got VALUE[: FIX]` unless `ok`.

    `name` is the option as the user writes it (the flat key, or `--flag` for a command's flags);
    `fix` says what to do when it is more than choosing an allowed value.
    """
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}{f': {fix}' if fix else ''}")
