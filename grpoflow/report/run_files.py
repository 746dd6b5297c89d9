"""Reading a run's output directory for its report, finished or still running.

A running run may be caught halfway through writing a line, and a resumed run may have logged a
step twice (a crash after the log line and before its checkpoint): a line that does not parse is
skipped, and of two rows of one step the later one counts. `completions.jsonl` may be large, so it
is read once, keeping only each step's highest- and lowest-advantage completions.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUN_FILE = "run.json"
"""The run's settings and what was chosen for it (written by `grpoflow.run.output_dir`)."""
METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"


@dataclass(frozen=True, slots=True)
class Sample:
    """One logged completion: its step, prompt, completion, rewards by name and advantage."""

    step: int
    prompt: str
    completion: str
    rewards: dict[str, float | None]
    advantage: float


@dataclass(slots=True)
class RunRecord:
    """What a report shows of a run: its logged steps, settings and sample completions."""

    output_dir: Path
    rows: list[dict[str, Any]]
    """One metrics row per logged step, in step order."""
    info: dict[str, Any] = field(default_factory=dict)
    """run.json: the run's id, when it started, and its settings (`config`) when recorded."""
    samples: dict[int, list[Sample]] = field(default_factory=dict)
    """Per step with logged completions: its highest-advantage samples, then its lowest."""
    skipped_lines: int = 0
    """Lines of metrics.jsonl that did not parse (a line still being written, a crash)."""

    @property
    def settings(self) -> dict[str, Any]:
        config = self.info.get("config")
        return config if isinstance(config, dict) else {}


def read_run(output_dir: str | Path, samples_per_side: int = 3) -> RunRecord:
    """Read a run's output directory; ValueError when it holds no run or no logged step yet."""
    directory = Path(output_dir)
    metrics = directory / METRICS_FILE
    if not directory.is_dir() or not (metrics.is_file() or (directory / RUN_FILE).is_file()):
        raise ValueError(
            f"{directory} is not a run's output directory (it holds no {METRICS_FILE} and no {RUN_FILE}); "
            "give the output_dir of a `grpoflow train` run"
        )
    rows, skipped = read_metrics(metrics) if metrics.is_file() else ([], 0)
    if not rows:
        raise ValueError(f"{directory} holds a run with no logged step yet: report it once a step is logged")
    return RunRecord(
        directory,
        rows,
        info=read_info(directory / RUN_FILE),
        samples=read_samples(directory / COMPLETIONS_FILE, samples_per_side),
        skipped_lines=skipped,
    )


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of a metrics log in step order, the last row of each step kept, and the number
    of lines that did not parse."""
    by_step: dict[int, dict[str, Any]] = {}
    skipped = 0
    for record in _records(path):
        if record is None or not isinstance(record.get("step"), int):
            skipped += 1
            continue
        by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)], skipped


def read_info(path: Path) -> dict[str, Any]:
    """run.json as a dict; empty when missing or unreadable."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def read_samples(path: Path, per_side: int) -> dict[int, list[Sample]]:
    """Per step, its `per_side` highest-advantage completions (highest first), then its
    `per_side` lowest (lowest last); nothing when the run logged no completions. A step logged
    twice by a resumed run keeps the later rows."""
    highest: dict[int, list] = {}
    lowest: dict[int, list] = {}
    order = itertools.count()  # ties keep the order of the file, and heaps never compare samples
    last_step = None
    for record in _records(path):
        sample = _sample(record)
        if sample is None:
            continue
        if sample.step != last_step and sample.step in highest:
            highest[sample.step], lowest[sample.step] = [], []  # the step again: a resumed run
        last_step = sample.step
        tick = next(order)
        _push(highest.setdefault(sample.step, []), (sample.advantage, -tick, sample), per_side)
        _push(lowest.setdefault(sample.step, []), (-sample.advantage, -tick, sample), per_side)
    result = {}
    for step in sorted(highest):
        top = [entry[2] for entry in sorted(highest[step], key=lambda e: (-e[0], -e[1]))]
        bottom = [entry[2] for entry in sorted(lowest[step], key=lambda e: (e[0], -e[1]))]
        seen = {id(sample) for sample in top}
        result[step] = top + [sample for sample in bottom if id(sample) not in seen]
    return result


def _push(heap: list, entry: tuple, size: int) -> None:
    """Keep the `size` largest entries in `heap`."""
    if len(heap) < size:
        heapq.heappush(heap, entry)
    elif entry[:2] > heap[0][:2]:
        heapq.heapreplace(heap, entry)


def _sample(record: dict[str, Any] | None) -> Sample | None:
    """A completions.jsonl row as a Sample; None for a row that lacks what the table shows."""
    if record is None:
        return None
    step, advantage = record.get("step"), record.get("advantage")
    if not isinstance(step, int) or not isinstance(advantage, int | float):
        return None
    rewards = record.get("rewards")
    conversation = record.get("conversation")
    completion = record.get("completion", "")
    return Sample(
        step=step,
        prompt=_shown(record.get("prompt", "")),
        completion=_shown(conversation if isinstance(conversation, list) and conversation else completion),
        rewards=rewards if isinstance(rewards, dict) else {},
        advantage=float(advantage),
    )


def _shown(value: Any) -> str:
    """A prompt or completion as the samples table shows it: text as it is; messages as a
    transcript, a line per turn (`role: text`, each tool call as `-> name(arguments)`)."""
    if not isinstance(value, list):
        return str(value)
    lines = []
    for message in value:
        if not isinstance(message, dict):
            lines.append(str(message))
            continue
        content = message.get("content")
        lines.append(f"{message.get('role', '?')}: {'' if content is None else content}")
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else {}
            lines.append(f"  -> {function.get('name', '?')}({function.get('arguments', '')})")
    return "\n".join(lines)


def _records(path: Path) -> Iterator[dict[str, Any] | None]:
    """Each line of a JSON-lines file as a dict, None for a line that is not one."""
    if not path.is_file():
        return
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                yield None
                continue
            yield record if isinstance(record, dict) else None
