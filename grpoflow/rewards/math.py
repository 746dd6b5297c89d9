"""Answer checking with math_verify: the `accuracy` reward and the correctness test `cosine` uses.

Gold answers come from the sample's `solution` column, else its `answer` column. GSM8K answers
(reasoning, then `#### 72`) are reduced to the text after the last `####`. A completion is reduced
to the content of its last `<answer>...</answer>` when it has one (else to the text after its last
`####`, else left whole); math_verify then finds LaTeX (`\\boxed{}` first), or a plain final
expression such as "The answer is 72." or "1,234".

math_verify bounds parsing and comparison with `signal.alarm`, which only works on the main thread
of a process. On the main thread (a process-pool worker runs its tasks there) those alarms are
used; on any other thread they are turned off and the runner's `reward_timeout` is the bound.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

from grpoflow.rewards.params import RewardConfig
from grpoflow.rewards.text import content_text

PARSE_TIMEOUT_SECONDS = 5
"""Per-expression bound math_verify puts on parsing and on comparing, when alarms can be used."""

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
logger = logging.getLogger("grpoflow.rewards")
_unparseable_gold_reported = False


def gold_text(solution: Any) -> str:
    """The gold answer text: what follows the last `####` (GSM8K), else the whole solution."""
    text = str(solution)
    return text.rsplit("####", 1)[1].strip() if "####" in text else text


def answer_text(completion: str) -> str:
    """The part of a completion that holds its answer (see the module docstring)."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1]
    return completion.rsplit("####", 1)[1] if "####" in completion else completion


def is_correct(completion: str, solution: Any) -> bool | None:
    """Whether `completion` states the answer of `solution`; None when the gold can't be parsed."""
    parse, verify, extraction = _math_verify()
    timeout = PARSE_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
    gold = parse(gold_text(solution), extraction_config=extraction, parsing_timeout=timeout)
    if not gold:
        _report_unparseable_gold(solution)
        return None
    answer = parse(answer_text(completion), extraction_config=extraction, parsing_timeout=timeout)
    if not answer:
        return False
    return bool(verify(gold, answer, timeout_seconds=timeout))


def final_answer(completion: str) -> str | None:
    """The completion's answer as math_verify reads it, normalised (so `0.5` and `0.50` agree), or
    None when it states none: what majority voting (maj@k) compares."""
    parse, _, extraction = _math_verify()
    timeout = PARSE_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
    parsed = parse(answer_text(completion), extraction_config=extraction, parsing_timeout=timeout)
    return str(parsed[0]) if parsed else None


def gold_column(columns: dict[str, Any], batch_size: int) -> Sequence[Any]:
    """The `solution` column, else the `answer` column, checked to be as long as the batch."""
    for name in ("solution", "answer"):
        values = columns.get(name)
        if values is not None:
            if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != batch_size:
                raise ValueError(
                    f"Column {name!r} must be a list with one gold answer per completion ({batch_size})."
                )
            return values
    raise ValueError(
        "This reward needs the gold answer in a 'solution' or 'answer' dataset column; got columns "
        f"{sorted(columns)}. Rename the dataset's answer column to 'solution'."
    )


class AccuracyReward:
    """1.0 when the completion's answer equals the gold answer, 0.0 when not, None when the gold
    can't be parsed. CPU-heavy (sympy), so the runner sends it to its process pool."""

    cpu_heavy = True

    def __init__(self, config: RewardConfig | None = None) -> None:
        require_math_verify("accuracy")
        self.config = config if config is not None else RewardConfig()

    @staticmethod
    def extract_answer(completion: Any) -> str | None:
        """The answer a completion states (text or messages), for majority voting."""
        return final_answer(content_text(completion))

    def __call__(self, completions: list, **kwargs: Any) -> list[float | None]:
        solutions = gold_column(kwargs, len(completions))
        results = [is_correct(content_text(c), s) for c, s in zip(completions, solutions)]
        return [None if ok is None else float(ok) for ok in results]


MATH_EXTRA_HINT = "pip install 'grpoflow[math]'"


def require_math_verify(reward: str) -> None:
    """Stop before any work when math_verify is missing (ValueError naming the install command):
    a reward that could not run would otherwise fail on every sample of the run."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        raise ValueError(
            f"The {reward} reward checks answers with math_verify, which is not installed: "
            f"{MATH_EXTRA_HINT} (or drop {reward} from reward_funcs)."
        ) from None


def _math_verify() -> tuple[Any, Any, list[Any]]:
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as error:
        raise ImportError(f"The accuracy and cosine rewards need math_verify: {MATH_EXTRA_HINT}") from error
    extraction = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse, verify, extraction


def _report_unparseable_gold(solution: Any) -> None:
    global _unparseable_gold_reported
    if not _unparseable_gold_reported:
        _unparseable_gold_reported = True
        logger.warning(
            "math_verify could not parse the gold answer %r; such samples get no accuracy reward "
            "(None). Shown once.",
            gold_text(solution)[:200],
        )
