"""Variants by name (advantage estimators, loss types): one way to add one and to look one up."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def add_entry(registry: dict[str, T], kind: str, name: str, entry: T) -> None:
    """Put `entry` in `registry` under `name`. A name another entry holds is an error naming the
    taken ones; the same entry again (a module imported twice) is none. `kind` names the option
    the names are values of."""
    if name in registry and registry[name] != entry:
        raise ValueError(
            f"{kind} {name!r} is already registered; choose another name (taken: {sorted(registry)})."
        )
    registry[name] = entry


def entry(registry: dict[str, T], kind: str, name: str) -> T:
    """The entry of `registry` under `name`; ValueError naming the known ones."""
    if name not in registry:
        raise ValueError(f"Unknown {kind} {name!r}; known: {sorted(registry)}.")
    return registry[name]
