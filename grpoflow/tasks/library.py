"""Tasks and environments of other libraries named by a spec: `LIBRARY:NAME`, optionally with
arguments as `?key=value&key=value` (each value read as a YAML scalar: `size=200` is a number,
`hard=true` a boolean). The one spec names the dataset and, for an environment, the environment
too (`reasoning_gym:basic_arithmetic?size=200&seed=3`, `verifiers:my_env?num_examples=50`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import yaml

EXTRA = "envs"
"""The optional dependencies that bring every library named here."""


@dataclass(frozen=True, slots=True)
class LibrarySpec:
    """One parsed spec."""

    library: str
    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(self.text)

    @property
    def text(self) -> str:
        """The spec as written in a config (arguments in their given order)."""
        query = "&".join(f"{key}={value}" for key, value in self.args.items())
        return f"{self.library}:{self.name}" + (f"?{query}" if query else "")


def parse_spec(spec: str, libraries: tuple[str, ...]) -> LibrarySpec | None:
    """`spec` parsed when it starts with one of `libraries` and a colon, else None."""
    library, colon, rest = spec.partition(":")
    if not colon or library not in libraries:
        return None
    name, _, query = rest.partition("?")
    if not name:
        raise ValueError(f"{spec!r} names no {library} task or environment: write {library}:NAME")
    args: dict[str, Any] = {}
    for pair in filter(None, query.split("&")):
        key, equals, value = pair.partition("=")
        if not equals or not key:
            raise ValueError(
                f"{spec!r}: {pair!r} is not an argument; write arguments as ?key=value&key=value"
            )
        args[key] = yaml.safe_load(value) if value else ""
    return LibrarySpec(library, name, args)


def import_library(module: str, package: str, needed_by: str) -> ModuleType:
    """The library's module, or one line saying which package and extra bring it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ValueError(
            f"{needed_by} needs the {package} package ({error}): pip install 'grpoflow[{EXTRA}]'"
        ) from None
