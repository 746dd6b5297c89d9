"""Building a dataclass tree from flat values, YAML and overrides (CPU)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from grpoflow.options import choices, flat_fields, flatten, load, to_flat
from grpoflow.options.loader import coerce

from .test_fields import Root


def test_flat_values_land_in_their_sections_and_derived_fields_follow():
    root = load(Root, {"max_completion_length": "64", "temperature": "0.7", "weight": 2})
    assert root.sampling.max_tokens == 64 and root.scoring.budget == 64
    assert root.sampling.temperature == pytest.approx(0.7) and root.scoring.weight == 2.0
    assert load(Root, {}).scoring.budget == 16


def test_mappings_under_section_names_are_read_as_flat_keys():
    values = {"sampling": {"temperature": 0.5}, "old_section": {"seed": 3}}
    assert flatten(Root, values, ("old_section",)) == {"temperature": 0.5, "seed": 3}
    root = load(Root, values, sections=("old_section",))
    assert (root.sampling.temperature, root.seed) == (0.5, 3)


def test_unknown_keys_suggest_close_ones_and_aliases_rename_or_drop():
    with pytest.raises(
        ValueError, match=r"unknown config key 'temperatur'; did you mean temperature\? \(see --help\)"
    ):
        load(Root, {"temperatur": 1}, hint="see --help")
    root = load(Root, {"heat": 0.3, "ignored": "x"}, aliases={"heat": "temperature", "ignored": None})
    assert root.sampling.temperature == pytest.approx(0.3)


def test_round_trip_through_flat_values():
    root = load(Root, {"max_completion_length": 32, "seed": 9})
    assert to_flat(root) == {"max_completion_length": 32, "temperature": 1.0, "weight": 1.0, "seed": 9}
    assert load(Root, to_flat(root)) == root


@pytest.mark.parametrize(
    ("value", "hint", "expected"),
    [
        ("3", int, 3),
        ("1e-6", float, 1e-6),
        ("on", bool, True),
        ("a, b", list[str], ["a", "b"]),
        ("null", int | None, None),
        (False, Literal["steps", "no"], "no"),  # YAML's reading of an unquoted `no`
        (True, Literal["true", "false", "x"], "true"),
    ],
)
def test_values_are_converted_to_the_declared_type(value, hint, expected):
    assert coerce("key", value, hint) == expected


def test_a_value_of_the_wrong_type_names_the_key():
    with pytest.raises(ValueError, match="seed must be an integer; got '1.5'"):
        load(Root, {"seed": "1.5"})


def test_a_mapping_option_reads_yaml_mappings_and_name_value_flags():

    hint = dict[str, str] | str | None
    assert coerce("env", {"a": "x:A"}, hint) == {"a": "x:A"}
    assert coerce("env", "a=x:A, b=y.py:B", hint) == {"a": "x:A", "b": "y.py:B"}
    assert coerce("env", ["a=x:A", "b=y.py:B"], hint) == {"a": "x:A", "b": "y.py:B"}
    assert coerce("env", "x:A", hint) == "x:A"  # no NAME=: the plain import path
    assert coerce("env", "null", hint) is None
    with pytest.raises(ValueError, match="env must be a mapping: NAME=VALUE pairs"):
        coerce("env", "a=x,=y", dict[str, str])


KINDS = {"plain": None, "fancy": None}


@dataclass(kw_only=True)
class Registered:
    kind: str = field(default="plain", metadata=choices(KINDS))
    """A name of the registry."""


def test_an_option_takes_the_names_its_registry_holds_when_read():
    assert load(Registered, {"kind": "fancy"}).kind == "fancy"
    with pytest.raises(ValueError, match="kind must be one of plain, fancy; got 'later'"):
        load(Registered, {"kind": "later"})
    KINDS["later"] = None  # registered after the fields were first read
    try:
        assert load(Registered, {"kind": "later"}).kind == "later"
        assert flat_fields(Registered)["kind"].value_hint == Literal["plain", "fancy", "later"]
    finally:
        del KINDS["later"]
