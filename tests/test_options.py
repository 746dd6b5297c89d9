"""`parse_overrides`: the command line's `--key value` words as config overrides (CPU)."""

import pytest

from grpoflow.options import parse_overrides


def test_parse_overrides_forms():
    argv = [
        "--learning_rate",
        "1e-6",
        "--max_steps=3",
        "--log_completions",
        "--reward_funcs",
        "accuracy",
        "format",
        "--top_k",
        "-1",
        "--max-prompt-length",
        "64",
    ]
    assert parse_overrides(argv) == {
        "learning_rate": "1e-6",
        "max_steps": "3",
        "log_completions": "true",
        "reward_funcs": ["accuracy", "format"],
        "top_k": "-1",
        "max_prompt_length": "64",
    }


def test_parse_overrides_inline_value_takes_no_following_words():
    assert parse_overrides(["--system=be brief", "--model", "tiny"]) == {
        "system": "be brief",
        "model": "tiny",
    }


def test_parse_overrides_empty_inline_value_stays_empty():
    # `--key=` says "empty", not "true", and must not swallow the next word.
    assert parse_overrides(["--system=", "--model", "tiny"]) == {"system": "", "model": "tiny"}
    with pytest.raises(ValueError, match="unexpected argument 'stray'"):
        parse_overrides(["--system=", "stray"])


@pytest.mark.parametrize("argv", [["tiny"], ["--"], ["--model", "tiny", "--"]])
def test_parse_overrides_rejects_positional_words(argv):
    with pytest.raises(ValueError, match="unexpected argument"):
        parse_overrides(argv)
