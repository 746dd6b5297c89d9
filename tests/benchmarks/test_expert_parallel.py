"""benchmarks/expert_parallel.py runs on two CPU ranks (gloo, the tiny Qwen3-MoE) and writes its
report: both layouts train the same model on the same batch to the same loss and gradient."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.support import clean_env, free_port

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "expert_parallel.py"


@pytest.mark.slow
def test_expert_parallel_and_fsdp_passes_agree_and_the_report_has_a_row_each(tmp_path):
    output = tmp_path / "report.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), str(SCRIPT), "--smoke", "--output", str(output)]
    result = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    report = json.loads(output.read_text())
    fsdp, ep = report["rows"]
    assert (fsdp["mode"], ep["mode"]) == ("fsdp", "ep") and report["ranks"] == 2
    assert ep["tokens"] == fsdp["tokens"] == 2 * 2 * 16 and ep["seconds"] > 0 and ep["peak_gib"] is None
    assert ep["loss"] == pytest.approx(fsdp["loss"], rel=1e-5)
    assert ep["grad_norm"] == pytest.approx(fsdp["grad_norm"], rel=1e-5)
