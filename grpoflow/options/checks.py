"""One way to refuse a bad value: the option's name, what it allows, what it got, and the fix."""

from __future__ import annotations


def require(ok: bool, name: str, allowed: str, value: object, fix: str = "") -> None:
    """Raise ValueError `NAME must be ALLOWED, got VALUE[: FIX]` unless `ok`.

    `name` is the option as the user writes it (the flat key, or `--flag` for a command's flags);
    `fix` says what to do when it is more than choosing an allowed value.
    """
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}{f': {fix}' if fix else ''}")


def require_min(name: str, value: float | None, minimum: float, note: str = "") -> None:
    """Refuse `value` below `minimum`; None (an option left unset) passes. `note` says why."""
    require(value is None or value >= minimum, name, f">= {minimum}{note}", value)


def require_fraction(name: str, value: float) -> None:
    """Refuse a share of memory outside (0, 1]."""
    require(0 < value <= 1, name, "in (0, 1]", value)
