import json
import logging
import sys
import threading
from pathlib import Path

import pytest

from grpoflow.rewards import get_reward
from grpoflow.rewards import math as reward_math
from grpoflow.rewards.math import answer_text, gold_text, is_correct

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")


def gsm8k_rows(count):
    if not GSM8K_TEST.exists():
        pytest.skip(f"GSM8K data not found at {GSM8K_TEST}")
    with GSM8K_TEST.open() as lines:
        return [json.loads(line) for _, line in zip(range(count), lines)]


@pytest.fixture
def accuracy():
    return get_reward("accuracy")


def test_gold_and_answer_text():
    assert gold_text("She pays 9 * 2 = 18.\n#### 18") == "18"
    assert gold_text("$\\frac{1}{2}$") == "$\\frac{1}{2}$"
    assert answer_text("<think>4 + 3</think><answer> 7 </answer>") == " 7 "
    assert answer_text("<answer>1</answer> then <answer>2</answer>") == "2"
    assert answer_text("so #### 7") == " 7"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("The answer is 72.", 1.0),
        ("<answer>72</answer>", 1.0),
        ("\\boxed{72}", 1.0),
        ("<think>70 + 2 = 72</think> <answer>72</answer>", 1.0),
        ("She had 3 then 72 apples.", 1.0),
        ("71", 0.0),
        ("<answer>71</answer>", 0.0),
        ("no number here", 0.0),
    ],
)
def test_gsm8k_gold(accuracy, completion, expected):
    gold = "Natalia sold 48 / 2 = 24 clips in May.\nShe sold 48 + 24 = 72 clips.\n#### 72"
    assert accuracy(prompts=["q"], completions=[completion], completion_ids=[[1]], answer=[gold]) == [
        expected
    ]


def test_thousands_separator(accuracy):
    assert accuracy(completions=["1,234", "1234", "\\boxed{1,234}"], answer=["#### 1234"] * 3) == [1.0] * 3
    assert accuracy(completions=["The total is 1234."], answer=["#### 1,234"]) == [1.0]


def test_first_gsm8k_test_rows(accuracy):
    rows = gsm8k_rows(20)
    golds = [row["answer"] for row in rows]
    numbers = [gold.rsplit("####", 1)[1].strip() for gold in golds]
    right = [f"<answer>{n}</answer>" for n in numbers]
    wrong = [f"<answer>{int(n.replace(',', '')) + 1}</answer>" for n in numbers]
    assert accuracy(completions=right, answer=golds) == [1.0] * 20
    assert accuracy(completions=wrong, answer=golds) == [0.0] * 20


def test_latex_solution_column_is_preferred(accuracy):
    result = accuracy(
        completions=["\\boxed{\\frac{1}{2}}", "so it is 0.5", "\\boxed{2}"],
        solution=["$\\frac{1}{2}$"] * 3,
        answer=["#### 99"] * 3,
    )
    assert result == [1.0, 1.0, 0.0]


def test_conversational_completions(accuracy):
    completions = [
        [{"role": "assistant", "content": "<answer>18</answer>"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "The answer is 19."}]}],
    ]
    assert accuracy(completions=completions, answer=["#### 18"] * 2) == [1.0, 0.0]


def test_unparseable_gold_gives_none_and_warns_once(accuracy, caplog, monkeypatch):
    monkeypatch.setattr(reward_math, "_unparseable_gold_reported", False)
    with caplog.at_level(logging.WARNING, logger="grpoflow.rewards"):
        result = accuracy(completions=["72", "73"], solution=["", "no answer"])
    assert result == [None, None]
    assert caplog.text.count("could not parse the gold answer") == 1


def test_missing_gold_column_names_the_fix(accuracy):
    with pytest.raises(ValueError, match="'solution' or 'answer'"):
        accuracy(completions=["72"], question=["q"])
    with pytest.raises(ValueError, match="one gold answer per completion"):
        accuracy(completions=["72", "1"], answer=["#### 72"])


def test_works_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(is_correct("\\boxed{72}", "#### 72")))
    thread.start()
    thread.join()
    assert results == [True]


def test_missing_math_verify_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'grpoflow\[math\]'"):
        is_correct("72", "#### 72")


def test_accuracy_is_marked_cpu_heavy(accuracy):
    assert accuracy.cpu_heavy is True


@pytest.mark.parametrize("name", ["accuracy", "cosine"])
def test_a_math_reward_without_math_verify_stops_before_any_work(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # what a missing package looks like to import
    with pytest.raises(ValueError, match=rf"The {name} reward .* pip install 'grpoflow\[math\]'"):
        get_reward(name)
