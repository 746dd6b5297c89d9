"""Every test reads and writes compile costs (`grpoflow.policy.compile_costs`) in a file of its
own, never the machine's: a cost an earlier run recorded would change what the plan chooses."""

from __future__ import annotations

import pytest

from grpoflow.policy import compile_costs


@pytest.fixture(autouse=True)
def own_compile_costs(tmp_path, monkeypatch):
    path = tmp_path / "compile_seconds.json"
    monkeypatch.setattr(compile_costs, "costs_path", lambda environ=None: path)
    return path
