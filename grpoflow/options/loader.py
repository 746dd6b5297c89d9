"""Reading a run's configuration: a YAML recipe, `--key value` flags, flat keys to typed sections.

Keys are flat (TRL's and ms-swift's names); each belongs to one section of `GRPOConfig`, except
`max_completion_length`, shared by generation and rewards. Values are converted to the field's
type (`"1e-6"` to a float, `"a,b"` to a list, `"null"` to None); unknown keys get the closest
known names in the error.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from grpoflow.run.config import GRPOConfig

KEY_ALIASES = {"overlong_filter": "mask_truncated_completions", "rlhf_type": None}
"""Other names users know for a key; None marks keys accepted and ignored (always GRPO here)."""


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> GRPOConfig:
    """Read a YAML recipe (or none) and apply overrides on top."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping of keys to values")
        values.update(_flatten_sections(loaded))
    values.update(overrides or {})
    return GRPOConfig.from_flat_dict(values)


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value`, `--flag` (true) and `--key v1 v2 ...` (lists) to a dict.

    Values stay strings; `GRPOConfig.from_flat_dict` converts them by the field's type.
    """
    overrides: dict[str, Any] = {}
    index = 0
    while index < len(argv):
        token = argv[index]
        if not token.startswith("--") or token == "--":
            raise ValueError(f"unexpected argument {token!r}: options look like --key value")
        key, equals, inline = token[2:].partition("=")
        key = key.replace("-", "_")
        index += 1
        values = [inline] if equals else []
        while not equals and index < len(argv) and not argv[index].startswith("--"):
            values.append(argv[index])
            index += 1
        overrides[key] = "true" if not values else values[0] if len(values) == 1 else values
    return overrides


def sections_from_flat(values: dict[str, Any]) -> dict[str, Any]:
    """GRPOConfig's sections built from flat keys (or keys nested under section names), each
    value checked and converted to its field's type."""
    owners = _key_owners()
    per_section: dict[str, dict[str, Any]] = {section.name: {} for section in _sections()}
    for raw_key, value in _flatten_sections(values).items():
        key = _canonical_key(raw_key)
        if key is None:
            continue
        if key not in owners:
            raise ValueError(_unknown_key_message(raw_key, owners))
        for section_name, hint in owners[key]:
            per_section[section_name][key] = _coerce(key, value, hint)
    sections = {}
    for section in _sections():
        try:
            sections[section.name] = _section_type(section)(**per_section[section.name])
        except (TypeError, ValueError) as error:
            raise ValueError(f"invalid config: {error}") from None
    return sections


def _sections() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(GRPOConfig)


def _section_type(section: dataclasses.Field) -> type:
    return typing.get_type_hints(GRPOConfig)[section.name]


def _key_owners() -> dict[str, list[tuple[str, Any]]]:
    owners: dict[str, list[tuple[str, Any]]] = {}
    for section in _sections():
        hints = typing.get_type_hints(_section_type(section))
        for item in dataclasses.fields(_section_type(section)):
            owners.setdefault(item.name, []).append((section.name, hints[item.name]))
    return owners


def _flatten_sections(values: dict[str, Any]) -> dict[str, Any]:
    section_names = {section.name for section in _sections()}
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in section_names and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def _canonical_key(key: str) -> str | None:
    key = key.replace("-", "_")
    return KEY_ALIASES.get(key, key) if key in KEY_ALIASES else key


def _unknown_key_message(key: str, owners: dict[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(owners) + list(KEY_ALIASES), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown config key {key!r}{hint} (`grpoflow train --help` lists the keys)"


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Convert `value` (from YAML or a flag) to the field's declared type or raise ValueError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in {"none", "null"})
        if is_none and type(None) in args:
            return None
        inner = [arg for arg in args if arg is not type(None)]
        return _coerce(key, value, inner[0])
    if origin is list:
        items = value if isinstance(value, list | tuple) else _split_list(value)
        return [_coerce(key, item, args[0]) for item in items]
    if origin is Literal:
        text = value if not isinstance(value, bool) else str(value).lower()
        if all(isinstance(arg, int) for arg in args) and isinstance(text, str) and text.isdigit():
            text = int(text)
        if text not in args:
            raise ValueError(f"{key} must be one of {', '.join(map(str, args))}; got {value!r}")
        return text
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text not in _TRUE | _FALSE:
                raise ValueError
            return text in _TRUE
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if hint is str:
            if value is None or isinstance(value, dict | list):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "text"}[hint]
        raise ValueError(f"{key} must be {kind}; got {value!r}") from None
    return value


def _split_list(value: Any) -> list[Any]:
    if value is None:  # a YAML key left empty
        return []
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return [value]
