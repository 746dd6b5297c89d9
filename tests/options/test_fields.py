"""Flat keys of a dataclass tree (CPU)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from grpoflow.options import NOT_AN_OPTION, default_of, derived_from, field_docs, flat_fields, key
from grpoflow.options.fields import derived_fields


@dataclass(kw_only=True, slots=True)
class Sampling:
    n: int = field(default=1, metadata=NOT_AN_OPTION)
    max_tokens: int = field(default=16, metadata=key("max_completion_length"))
    """Most new tokens."""
    temperature: float = 1.0
    """Softmax temperature.

    A second paragraph that the one-line documentation leaves out."""


@dataclass(kw_only=True, slots=True)
class Scoring:
    budget: int = field(default=16, metadata=derived_from("max_completion_length"))
    weight: float = 1.0


@dataclass(kw_only=True)
class Root:
    sampling: Sampling = field(default_factory=Sampling)
    scoring: Scoring = field(default_factory=Scoring)
    seed: int = 0


def test_every_leaf_has_one_key_and_a_path():
    fields = flat_fields(Root)
    assert set(fields) == {"max_completion_length", "temperature", "weight", "seed"}
    assert fields["max_completion_length"].path == ("sampling", "max_tokens")
    assert fields["max_completion_length"].owner is Sampling
    assert fields["seed"].default == 0


def test_a_key_owned_twice_is_refused():
    @dataclass(kw_only=True)
    class Twice:
        sampling: Sampling = field(default_factory=Sampling)
        temperature: float = 0.5

    with pytest.raises(
        ValueError, match="option 'temperature' has two owners: sampling.temperature and temperature"
    ):
        flat_fields(Twice)


def test_derived_fields_name_the_key_they_read():
    assert derived_fields(Root) == {("scoring", "budget"): "max_completion_length"}
    assert default_of(Sampling, "max_tokens") == 16


def test_field_docs_take_the_first_paragraph_and_follow_the_bases():
    assert field_docs(Sampling)["temperature"] == "Softmax temperature."

    @dataclass(kw_only=True, slots=True)
    class Wider(Sampling):
        top_p: float = 1.0
        """Nucleus mass."""

    docs = field_docs(Wider)
    assert docs["max_tokens"] == "Most new tokens." and docs["top_p"] == "Nucleus mass."


def test_the_run_and_the_server_give_each_key_one_owner():
    from grpoflow.run.config import GRPOConfig
    from grpoflow.server.settings import ServeConfig

    run_keys, serve_keys = flat_fields(GRPOConfig), flat_fields(ServeConfig)
    assert run_keys["temperature"].path == ("generation", "sampling", "temperature")
    assert run_keys["max_completion_length"].path == ("generation", "sampling", "max_tokens")
    assert run_keys["gpu_memory_utilization"].path == ("generation", "engine", "gpu_memory_utilization")
    assert serve_keys["max_num_seqs"].default == run_keys["max_num_seqs"].default
