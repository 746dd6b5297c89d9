"""Where a benchmark's JSON report goes: the path given, else benchmarks/results/<name>; a copy in
$OUT when that is set (a device run's files come back from there)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def write_report(report: dict, name: str, output: str | None) -> list[Path]:
    """`report` as JSON to `output` (or RESULTS/`name`) and $OUT/`name`; the paths written."""
    paths = [Path(output) if output else RESULTS / name]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / name)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    return paths


def save_result(kind: str, tag: str, device: str, output: str | None = None, **results) -> dict:
    """`results` with the date, `device` and torch's version, as RESULTS/DATE-KIND[-TAG]-DEVICE.json
    (or `output`), each path written printed; the report."""
    import torch

    date = datetime.date.today().isoformat()
    report = {"date": date, "device": device, "torch": torch.__version__, **results}
    name = f"{date}-{kind}{f'-{tag}' if tag else ''}-{device.replace(' ', '_')}.json"
    for path in write_report(report, name, output):
        print(f"wrote {path}")
    return report
