"""Command-line flags derived from a dataclass tree (CPU)."""

from __future__ import annotations

import argparse

import pytest

from grpoflow.options import add_flags, from_flags, require, require_fraction, require_min

from .test_fields import Root


def parse(argv: list[str]) -> Root:
    parser = argparse.ArgumentParser()
    add_flags(parser, Root)
    return from_flags(Root, parser.parse_args(argv))


def test_flags_take_dashed_keys_and_keep_defaults_for_the_rest():
    root = parse(["--max-completion-length", "8", "--temperature", "0.2"])
    assert (root.sampling.max_tokens, root.scoring.budget, root.sampling.temperature) == (8, 8, 0.2)
    assert parse([]) == Root()


def test_help_shows_each_fields_documentation_and_default(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    assert "--max-completion-length" in out and "Most new tokens. (default: 16)" in out


def test_the_serve_command_has_a_flag_for_every_setting(capsys):
    from grpoflow import cli
    from grpoflow.options import flat_fields
    from grpoflow.server.settings import ServeConfig

    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert all(f"--{name.replace('_', '-')}" in out for name in flat_fields(ServeConfig))


def test_one_message_shape_for_every_refusal():
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 2$"):
        require(False, "top_p", "in (0, 1]", 2)
    with pytest.raises(ValueError, match=r"^port must be free, got 80: choose another$"):
        require(False, "port", "free", 80, "choose another")
    with pytest.raises(ValueError, match=r"^max_staleness must be >= 1 \(why\), got 0$"):
        require_min("max_staleness", 0, 1, " (why)")
    require_min("unset", None, 1)
    with pytest.raises(ValueError, match=r"^share must be in \(0, 1\], got 0$"):
        require_fraction("share", 0)
