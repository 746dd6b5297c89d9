"""Command-line flags derived from a dataclass tree, in `vllm serve`'s style (`--max-num-seqs`).

Every flat key becomes `--key-with-dashes`, documented by the field's docstring and default; a
false-by-default boolean is a switch. Values go through the same conversion as YAML and
`--key value` overrides, so a command and its config cannot disagree on a name, type or default.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from grpoflow.options.fields import field_docs, flat_fields
from grpoflow.options.loader import load


def flag_name(key: str) -> str:
    """`--max-num-seqs` for the key `max_num_seqs`."""
    return "--" + key.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, root: type) -> None:
    """One flag per flat key of `root`; flags left out keep the field's default."""
    for key, item in flat_fields(root).items():
        doc = field_docs(item.owner).get(item.path[-1], "")
        required = item.default is dataclasses.MISSING
        if item.hint is bool and item.default is False:
            parser.add_argument(flag_name(key), action="store_true", default=argparse.SUPPRESS, help=doc)
            continue
        shown = "" if required or item.default is None else f" (default: {item.default})"
        parser.add_argument(flag_name(key), default=argparse.SUPPRESS, required=required, help=doc + shown)


def from_flags(root: type, namespace: argparse.Namespace) -> Any:
    """`root` built from parsed flags (converted and checked as any other values)."""
    return load(root, vars(namespace))
