"""Print a table of a run's per-step metrics (time split by phase, throughput, memory).

python benchmarks/summarize_run.py OUTPUT_DIR/metrics.jsonl
"""

from __future__ import annotations

import json
import sys

COLUMNS = [
    ("step", "step", "{:.0f}"),
    ("time/step", "step s", "{:.2f}"),
    ("time/rollout", "rollout s", "{:.2f}"),
    ("time/reward", "reward s", "{:.2f}"),
    ("time/update", "update s", "{:.2f}"),
    ("time/sync", "sync s", "{:.3f}"),
    ("tokens_per_second/rollout", "gen tok/s", "{:.0f}"),
    ("completions/mean_length", "mean len", "{:.1f}"),
    ("reward", "reward", "{:.3f}"),
    ("memory/max_allocated_gib", "peak GiB", "{:.1f}"),
]


def main(path: str) -> None:
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    print(" | ".join(title for _, title, _ in COLUMNS))
    for row in rows:
        cells = [fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in COLUMNS]
        print(" | ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1])
