"""The README's Python quickstart runs as it is written (but for its number of steps), offline on
the CPU, in a process of its own as a user's script would."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[2] / "README.md"


@pytest.mark.slow
def test_the_readme_python_quickstart_runs_as_written(tmp_path):
    script = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    assert "from grpoflow import GRPOConfig, GRPOTrainer" in script
    assert "max_steps=100" in script
    script = script.replace("max_steps=100", "max_steps=2")
    (tmp_path / "quickstart.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "quickstart.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^reward [0-9.]+ -> [0-9.]+$", done.stdout, re.M), done.stdout[-2000:]
    assert (tmp_path / "outputs" / "python" / "final" / "config.json").is_file()
