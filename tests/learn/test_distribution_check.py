"""The engine/trainer check of the whole next-token distribution: logged on every batch of a
native-engine run, near 0 when both run the same weights, large and warned about when not."""

from __future__ import annotations

import logging

import torch
from helpers.support import recipe

from grpoflow.learn.distribution_check import distribution_distances
from grpoflow.run.build import run
from grpoflow.run.health import HealthConfig, HealthMonitor

KEYS = [f"sampling/distribution_{name}/{stat}" for name in ("tv", "kl") for stat in ("mean", "max")]


def test_distances_of_known_distributions():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.2, 0.3, 0.5]])
    tv, kl = distribution_distances(p.log(), q.log())
    assert torch.allclose(tv, torch.tensor([0.5, 0.0])) and torch.allclose(kl, torch.tensor([0.6931472, 0.0]))


def test_a_native_run_checks_the_whole_distribution_on_every_batch(tmp_path):
    history = run(recipe(tmp_path, max_steps=2, top_p=0.9, distribution_check_positions=16))
    for step in history:
        assert all(key in step for key in KEYS)
        assert step["sampling/distribution_tv/max"] < 1e-5 and step["sampling/distribution_kl/max"] < 1e-5


def test_engines_that_cannot_return_distributions_skip_the_check_with_one_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="grpoflow"):
        history = run(recipe(tmp_path, max_steps=1, rollout_engine="hf"))
    assert not any(key in step for step in history for key in KEYS)
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("distribution_check_positions")
    ]
    assert len(lines) == 1 and "hf engine" in lines[0]


def test_a_large_distribution_gap_warns_naming_its_likely_causes():
    monitor = HealthMonitor(HealthConfig(health_window=2))
    findings = monitor.update(1, {"sampling/distribution_tv/max": 0.3})
    (finding,) = [f for f in findings if f.check == "distribution_gap"]
    assert "weights not synced" in finding.message and "attention" in finding.message
    assert not [
        f for f in monitor.update(2, {"sampling/distribution_tv/max": 0.01}) if f.check == "distribution_gap"
    ]


def test_a_run_sharing_prompts_still_checks_the_distribution(tmp_path, monkeypatch):
    """Shared prompts run where the CPU is let choose them (the per-sequence attention): the check
    reads the packed states that predict its tokens, each prompt packed once."""
    import json

    from grpoflow.learn import distribution_check
    from grpoflow.run import chosen_settings

    monkeypatch.setattr(chosen_settings, "shared_prompts_refusal", lambda config, device: None)
    packs = []
    packed = distribution_check.DistributionTap.packed
    monkeypatch.setattr(
        distribution_check.DistributionTap,
        "packed",
        lambda tap, pack: packs.append(pack) or packed(tap, pack),
    )
    history = run(recipe(tmp_path, max_steps=2, top_p=0.9, distribution_check_positions=16))
    chosen = json.loads((tmp_path / "run" / "run.json").read_text())["chosen_settings"]
    assert chosen["shared_prompts"]["value"] is True
    assert packs and all(pack.key_index is not None for pack in packs)  # tapped rows ran shared
    for step in history:
        assert all(key in step for key in KEYS)
        assert step["sampling/distribution_tv/max"] < 1e-5 and step["sampling/distribution_kl/max"] < 1e-5


def test_a_packed_run_checks_the_distribution(tmp_path):
    """`padding_free`: the tapped rows run end to end in one row, the check reads it."""
    history = run(
        recipe(
            tmp_path,
            max_steps=2,
            top_p=0.9,
            distribution_check_positions=16,
            padding_free=True,
            attn_implementation="grpoflow_varlen",
        )
    )
    for step in history:
        assert all(key in step for key in KEYS)
        assert step["sampling/distribution_tv/max"] < 1e-5 and step["sampling/distribution_kl/max"] < 1e-5
