"""Typed options for any component: flat keys, YAML and command-line flags onto a dataclass tree.

A component owns a dataclass of its settings (one docstring per field, checks in `__post_init__`
through `require`); a parent composes its children's dataclasses as fields. The loader knows no
component: it walks the tree, gives every leaf field one flat key (its name, or the `key` in its
metadata), refuses a tree where two fields claim one key, and builds the tree from flat values.

    config = load(GRPOConfig, {"learning_rate": "1e-6", "num_generations": 8})
    flat_fields(GRPOConfig)["temperature"].path   # ("generation", "sampling", "temperature")
"""

from grpoflow.options.checks import require, require_fraction, require_min
from grpoflow.options.fields import (
    NOT_AN_OPTION,
    FlatField,
    choices,
    default_of,
    derived_from,
    field_docs,
    flat_fields,
    key,
)
from grpoflow.options.flags import add_flags, from_flags
from grpoflow.options.loader import apply_derived, flatten, load, load_yaml, parse_overrides, to_flat

__all__ = [
    "NOT_AN_OPTION",
    "FlatField",
    "add_flags",
    "apply_derived",
    "choices",
    "default_of",
    "derived_from",
    "field_docs",
    "flat_fields",
    "flatten",
    "from_flags",
    "key",
    "load",
    "load_yaml",
    "parse_overrides",
    "require",
    "require_fraction",
    "require_min",
    "to_flat",
]
