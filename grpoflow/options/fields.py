"""The flat keys of a dataclass tree: which field owns each key, its type and its documentation.

A field whose type is a dataclass is a node: its own fields are read in turn. Every other field is
a leaf with one flat key: its name, or `metadata["key"]` (`key("max_completion_length")`) where
the component's name differs from the one users know. A leaf marked `NOT_AN_OPTION` is set by
the code that uses the component (per request, or from another option) and has no key. A leaf
whose values are the names of a registry (`choices(LOSS_TYPES)`) takes them as a `Literal` of the
names registered when a value is read or shown, plugins' included.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

NOT_AN_OPTION = {"option": False}
"""Field metadata: set by the code that uses the component (per request, or from another option),
not by a key of its own."""


def derived_from(flat_key: str) -> dict[str, Any]:
    """Field metadata: not an option of its own; the loader gives it the value of option
    `flat_key` (a component that reads another component's setting, as rewards read the
    completion budget)."""
    return {**NOT_AN_OPTION, "from": flat_key}


def key(name: str) -> dict[str, str]:
    """Field metadata: the field's flat key is `name` instead of its attribute name."""
    return {"key": name}


def choices(registry: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Field metadata: the option takes one of `registry`'s names, those registered when a value
    is read or shown (a component's variants registered by name, plugins' included)."""
    return {"choices": registry}


@dataclass(frozen=True, slots=True)
class FlatField:
    """Where one flat key lands in the tree."""

    path: tuple[str, ...]
    """Attribute names from the root to the field."""
    hint: Any
    """The field's resolved type annotation."""
    owner: type
    """The dataclass that declares the field."""
    default: Any
    """The field's default (dataclasses.MISSING when required)."""
    choices: Mapping[str, Any] | None = field(default=None, compare=False)
    """The registry whose names the option takes (`choices`), or None."""

    @property
    def value_hint(self) -> Any:
        """The type a value is read as: `hint`, or a Literal of the registry's names now."""
        return self.hint if self.choices is None else Literal[tuple(self.choices)]


def is_node(hint: Any) -> bool:
    """Whether a field of type `hint` is a nested section (a dataclass), not a leaf."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


@functools.cache
def flat_fields(root: type) -> dict[str, FlatField]:
    """Every flat key of `root`'s tree. ValueError when two fields claim the same key."""
    found: dict[str, FlatField] = {}
    for item, flat in _leaves(root, ()):
        if not item.metadata.get("option", True):
            continue
        flat_key = item.metadata.get("key", item.name)
        if flat_key in found:
            first, second = ".".join(found[flat_key].path), ".".join(flat.path)
            raise ValueError(f"option {flat_key!r} has two owners: {first} and {second}; give one a key")
        found[flat_key] = flat
    return found


@functools.cache
def derived_fields(root: type) -> dict[tuple[str, ...], str]:
    """The path of every `derived_from` field of `root`'s tree, with the key it takes its value from."""
    return {flat.path: item.metadata["from"] for item, flat in _leaves(root, ()) if "from" in item.metadata}


def _leaves(cls: type, prefix: tuple[str, ...]) -> Iterator[tuple[dataclasses.Field, FlatField]]:
    """Every leaf field of `cls`'s tree with where it lands, nested sections read in turn."""
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        hint, path = hints[item.name], (*prefix, item.name)
        if is_node(hint):
            yield from _leaves(hint, path)
        else:
            yield item, FlatField(path, hint, cls, _default(item), item.metadata.get("choices"))


def _default(item: dataclasses.Field) -> Any:
    return item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default


def nodes(root: type) -> set[str]:
    """Names of the nested sections anywhere in `root`'s tree (a mapping under one is read as flat keys)."""
    hints = typing.get_type_hints(root)
    names = set()
    for item in dataclasses.fields(root):
        if is_node(hints[item.name]):
            names |= {item.name, *nodes(hints[item.name])}
    return names


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass `cls` or a dataclass it extends (its
    first paragraph, on one line)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for statement, following in zip(body, body[1:]):
        is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and is_doc:
            text = str(following.value.value).strip().split("\n\n")[0]
            docs[statement.target.id] = " ".join(text.split())
    return docs


def default_of(cls: type, name: str) -> Any:
    """The default of field `name` of dataclass `cls`: for a field that takes its value from
    another component's option, so that the default is written once, by the option's owner."""
    return _default(next(item for item in dataclasses.fields(cls) if item.name == name))
