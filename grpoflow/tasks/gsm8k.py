"""GSM8K (MIT license, see data/gsm8k/LICENSE): grade-school math word problems.

Rows hold `question` (the prompt) and `answer` (worked solution ending in `#### N`), which the
accuracy reward reads.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data" / "gsm8k"


def load_rows(split: str = "train") -> list[dict]:
    path = DATA_DIR / f"{split}.jsonl.gz"
    if not path.is_file():
        raise ValueError(f"gsm8k has splits train and test, not {split!r}")
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
