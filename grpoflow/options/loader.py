"""Building a dataclass tree from flat values: YAML mappings, `--key value` flags, Python dicts.

Values are converted to the field's declared type (`"1e-6"` to a float, `"a,b"` to a list,
`"null"` to None); a mapping under a section's name is read as flat keys; an unknown key gets the
closest known names in its error. Each node is built with its own constructor, so its
`__post_init__` checks run, and a parent's after its children's.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from grpoflow.options.fields import derived_fields, flat_fields, is_node, nodes


def load(
    root: type,
    values: Mapping[str, Any],
    *,
    aliases: Mapping[str, str | None] | None = None,
    sections: Collection[str] = (),
    hint: str = "",
) -> Any:
    """`root` built from flat `values` (or values nested under section names), each converted to
    its field's type. `aliases` maps other names users know to a key (None: accepted and ignored);
    `sections` names more sections whose keys are read as flat keys (those of earlier layouts);
    `hint` ends the unknown-key message (where to find the keys)."""
    owners, aliases = flat_fields(root), aliases or {}
    leaves: dict[tuple[str, ...], Any] = {}
    for raw_key, value in flatten(root, values, sections).items():
        name = raw_key.replace("-", "_")
        name = aliases.get(name, name) if name in aliases else name
        if name is None:
            continue
        if name not in owners:
            close = difflib.get_close_matches(name, [*owners, *aliases], n=3)
            suggestion = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown config key {raw_key!r}{suggestion}{f' ({hint})' if hint else ''}")
        leaves[owners[name].path] = coerce(name, value, owners[name].value_hint)
    for path, source in derived_fields(root).items():  # before the sections check their values
        if owners[source].path in leaves:
            leaves[path] = leaves[owners[source].path]
    try:
        return _build(root, (), leaves)
    except (TypeError, ValueError) as error:
        raise ValueError(f"invalid config: {error}") from None


def apply_derived(tree: Any) -> None:
    """Set each `derived_from` field of `tree`, a root config built in Python, to the value of the
    option it derives from (`load` sets them before the sections check their values): a section
    reads another section's setting only by declaring it `derived_from`."""
    owners = flat_fields(type(tree))
    for path, source in derived_fields(type(tree)).items():
        value = tree
        for name in owners[source].path:
            value = getattr(value, name)
        setattr(tree, path[0], _replaced(getattr(tree, path[0]), path[1:], value))


def _replaced(node: Any, path: tuple[str, ...], value: Any) -> Any:
    """`node` with the field at `path` below it set to `value` (a copy when it changes)."""
    name, rest = path[0], path[1:]
    current = getattr(node, name)
    new = _replaced(current, rest, value) if rest else value
    return node if new == current else dataclasses.replace(node, **{name: new})


def _build(cls: type, prefix: tuple[str, ...], leaves: dict[tuple[str, ...], Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for item in dataclasses.fields(cls):
        path = (*prefix, item.name)
        if is_node(hints[item.name]):
            if any(given[: len(path)] == path for given in leaves):
                kwargs[item.name] = _build(hints[item.name], path, leaves)
        elif path in leaves:
            kwargs[item.name] = leaves[path]
    return cls(**kwargs)


def flatten(root: type, values: Mapping[str, Any], sections: Collection[str] = ()) -> dict[str, Any]:
    """`values` with every mapping under a section name of `root`'s tree (or one of `sections`)
    merged in as flat keys."""
    names = nodes(root) | set(sections)
    flat: dict[str, Any] = {}
    for name, value in values.items():
        if name in names and isinstance(value, Mapping):
            flat.update(flatten(root, value, sections))
        else:
            flat[name] = value
    return flat


def to_flat(config: Any) -> dict[str, Any]:
    """Every option of a built tree as one flat mapping of key to value (what a recipe holds)."""
    flat = {}
    for name, item in flat_fields(type(config)).items():
        value = config
        for attribute in item.path:
            value = getattr(value, attribute)
        flat[name] = list(value) if isinstance(value, tuple) else value
    return flat


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML file holds; ValueError when the file is missing or holds something else."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(error, "problem", None) or "it cannot be parsed"
        raise ValueError(f"config file {path} is not valid YAML{line}: {problem}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {path} must hold a mapping of keys to values")
    return loaded


def parse_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """`--key value`, `--key=value`, `--flag` (true) and `--key v1 v2 ...` (lists) to a dict.

    Values stay strings; `load` converts them by the field's type.
    """
    overrides: dict[str, Any] = {}
    index = 0
    while index < len(argv):
        token = argv[index]
        if not token.startswith("--") or token == "--":
            raise ValueError(f"unexpected argument {token!r}: options look like --key value")
        name, equals, inline = token[2:].partition("=")
        name = name.replace("-", "_")
        index += 1
        values = [inline] if equals else []
        while not equals and index < len(argv) and not argv[index].startswith("--"):
            values.append(argv[index])
            index += 1
        overrides[name] = BareFlag("true") if not values else values[0] if len(values) == 1 else values
    return overrides


class BareFlag(str):
    """The value of a flag given with no value: true for a boolean option, an error for others."""


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def coerce(name: str, value: Any, hint: Any) -> Any:
    """`value` (from YAML or a flag) converted to the declared type `hint`, or ValueError naming `name`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in {"none", "null"})
        if is_none and type(None) in args:
            return None
        return _first_fitting(name, value, [arg for arg in args if arg is not type(None)])
    if origin in (list, tuple, Sequence):
        items = value if isinstance(value, list | tuple) else _split_list(value)
        return [coerce(name, item, args[0]) for item in items]
    if origin in (dict, Mapping):
        return {
            coerce(name, key, args[0]): coerce(name, item, args[1])
            for key, item in _mapping(name, value).items()
        }
    if origin is Literal:
        return _literal(name, value, args)
    if isinstance(value, BareFlag) and hint is not bool:
        raise ValueError(f"{name} needs a value: --{name} VALUE")
    if hint not in _KINDS:
        return value
    try:
        return _scalar(value, hint)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {_KINDS[hint]}; got {value!r}") from None


def _first_fitting(name: str, value: Any, hints: list[Any]) -> Any:
    """`value` as the first type of a union it converts to (a union's types in declared order)."""
    for hint in hints[:-1]:
        try:
            return coerce(name, value, hint)
        except ValueError:
            continue
    return coerce(name, value, hints[-1])


def _mapping(name: str, value: Any) -> Mapping[Any, Any]:
    """A mapping option from YAML (a mapping) or a flag (`a=x,b=y`, or `a=x b=y`)."""
    if isinstance(value, Mapping):
        return value
    items = value if isinstance(value, list | tuple) else _split_list(value)
    pairs = [str(item).partition("=") for item in items]
    if not pairs or any(not equals or not key.strip() for key, equals, _ in pairs):
        raise ValueError(f"{name} must be a mapping: NAME=VALUE pairs separated by commas; got {value!r}")
    return {key.strip(): item.strip() for key, _, item in pairs}


def _literal(name: str, value: Any, allowed: tuple) -> Any:
    text = value if not isinstance(value, bool) else str(value).lower()
    if isinstance(value, bool) and text not in allowed:
        text = "yes" if value else "no"  # YAML 1.1 reads an unquoted no/yes/off/on as a bool
    if all(isinstance(arg, int) for arg in allowed) and isinstance(text, str) and text.isdigit():
        text = int(text)
    if text not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")
    return text


def _scalar(value: Any, hint: type) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() not in _TRUE | _FALSE:
            raise ValueError
        return str(value).lower() in _TRUE
    if isinstance(value, bool) or (hint is str and (value is None or isinstance(value, dict | list))):
        raise ValueError
    if hint is int and isinstance(value, float) and not value.is_integer():
        raise ValueError
    return hint(value)


def _split_list(value: Any) -> list[Any]:
    if value is None:  # a YAML key left empty
        return []
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return [value]
