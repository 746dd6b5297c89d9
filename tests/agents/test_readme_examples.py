"""Every agent example of the README runs on the embedded tiny model, offline on the CPU: its
commands (with `--model tiny`) and its code, for one step each."""

from __future__ import annotations

import json
import logging
import re
import shlex
from pathlib import Path

import pytest

from grpoflow import cli

README = Path(__file__).parents[2] / "README.md"
SMALL = {
    "max_steps": "1",
    "num_generations": "2",
    "per_device_train_batch_size": "4",
    "gradient_accumulation_steps": "1",
    "max_prompt_length": "440",
    "max_completion_length": "48",
    "max_turn_tokens": "8",
    "report_to": "none",
    "html_report": "false",
    "disable_tqdm": "true",
}
"""One small step: a few episodes of a few tokens (the tiny model has 512 positions)."""

TOOLS_FILE = '''
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers and + - * /.
    """
    return str(eval(expression, {"__builtins__": {}}))
'''
AGENT_HELPERS = """
import json

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


def run_tool(call):
    arguments = json.loads(call.function.arguments)
    return str(arguments.get("a", 0) + arguments.get("b", 0))


def check(content, answer):
    return (content or "").strip() == answer.split("####")[-1].strip()
"""
ROLLOUT_HELPERS = """
class Scorer:
    def score(self, text):
        return float(len(text))


my_env = Scorer()


def env_reward(completions, env_reward, **kwargs):
    return env_reward
"""


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n{title}\n")
    end = re.search(r"\n#{2,3} ", text[start + len(title) + 2 :])
    return text[start : start + len(title) + 2 + (end.start() if end else len(text))]


def code(title: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section(title), re.S)


def train_commands(title: str) -> list[list[str]]:
    """The `grpoflow train` command lines of a section's shell blocks, comments dropped."""
    lines = "\n".join(code(title, "bash")).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True)[1:] for line in lines if line.startswith("grpoflow train")]


def short_gsm8k(directory: Path) -> str:
    """Rows with GSM8K's columns and short questions: GSM8K's own, with a tool's schema, outgrow
    the tiny model's 512 positions."""
    path = directory / "short_gsm8k.jsonl"
    rows = [{"question": f"What is {a} + 3?", "answer": f"{a} + 3 = {a + 3}\n#### {a + 3}"} for a in range(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def train(tmp_path: Path, argv: list[str], **extra: str) -> list[dict]:
    """Run `grpoflow train argv` on the tiny model for one small step; its logged metrics."""
    argv = list(argv)
    if "--model" in argv:
        argv[argv.index("--model") + 1] = "tiny"
    if "gsm8k" in argv:
        argv[argv.index("gsm8k")] = short_gsm8k(tmp_path)
    settings = {**SMALL, **extra, "output_dir": str(tmp_path / f"run{len(list(tmp_path.glob('run*')))}")}
    flags = [item for key, value in settings.items() for item in (f"--{key}", value)]
    assert cli.main([*argv, *flags]) == 0
    metrics = Path(settings["output_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.slow
def test_the_tools_and_environment_commands_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_tools.py").write_text(TOOLS_FILE)
    relay, tools = train_commands("## Agents: tools and environments")
    assert relay[:3] == ["train", "--config", "relay"] and "--tools" in tools
    assert train(tmp_path, relay)[-1]["episodes/ended_by/error"] == 0
    (step,) = train(tmp_path, tools)
    assert step["episodes/ended_by/error"] == 0 and step["episodes/num_errors"] == 0


class Guess:
    """A TRL-style environment: its public method is a tool, get_reward scores the episode."""

    def reset(self, **row):
        self.guesses = 0

    def guess(self, letter: str) -> str:
        """Guess the letter.

        Args:
            letter: One letter.
        """
        self.guesses += 1
        return "yes" if letter == "a" else "no"

    def get_reward(self) -> float:
        return float(self.guesses)


@pytest.mark.slow
def test_a_trl_style_tool_environment_runs(tmp_path):
    factory = f"{__name__}:Guess" if "." not in __name__ else f"{__name__}.Guess"
    argv = ["train", "--model", "tiny", "--dataset", "echo", "--environment_factory", factory]
    (step,) = train(tmp_path, [*argv, "--max_tool_calling_iterations", "2"])
    assert step["episodes/num_errors"] == 0 and "rewards/Guess/mean" in step


@pytest.mark.slow
def test_the_rollout_function_example_runs(tmp_path):
    (source,) = code("### Rollout functions", "python")
    path = tmp_path / "my_rollout.py"
    path.write_text(ROLLOUT_HELPERS + source)
    argv = ["train", "--model", "tiny", "--dataset", "echo", "--rollout_func", f"{path}:rollout_func"]
    (step,) = train(tmp_path, [*argv, "--reward_funcs", f"{path}:env_reward"])
    assert step["rewards/env_reward/mean"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize("which", ["program", "recipe"])
def test_the_agent_program_examples_run(tmp_path, monkeypatch, caplog, which):
    """The README's program (its helpers defined) and the packaged relay-agent recipe; the
    HTTP client logs none of the run's requests."""
    caplog.set_level(logging.INFO)
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    monkeypatch.chdir(tmp_path)
    (source,) = code("### Agent programs", "python")
    (tmp_path / "my_agent.py").write_text(AGENT_HELPERS + source)
    program, recipe = train_commands("### Agent programs")
    (step,) = train(tmp_path, program if which == "program" else recipe)
    assert step["episodes/errors"] == 0 and step["episodes/turns_mean"] >= 1
    assert not [record for record in caplog.records if record.name.startswith(("httpx", "httpcore"))]


@pytest.mark.slow
def test_the_walkthrough_trains_its_task_both_ways(tmp_path, monkeypatch):
    """The README's walkthrough: its data, its environment class and its agent program, each
    command one step on the tiny model."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    monkeypatch.chdir(tmp_path)
    title = "### From a task idea to a trained agent"
    (rows,) = code(title, "jsonl")
    (tmp_path / "words.jsonl").write_text(rows)
    game, agent = code(title, "python")
    (tmp_path / "word_game.py").write_text(game)
    (tmp_path / "word_agent.py").write_text(agent)
    environment, program = train_commands(title)
    (step,) = train(tmp_path, environment)
    assert step["episodes/num_errors"] == 0 and "rewards/WordGame/mean" in step
    (step,) = train(tmp_path, program)
    assert step["episodes/errors"] == 0 and "rewards/agent_program/mean" in step
