"""The update's metrics accumulator: means, extremes and (sum, count) pairs, one copy to the host (CPU)."""

from __future__ import annotations

import torch

from grpoflow.learn.accumulator import MetricsAccumulator


def test_means_extremes_and_pairs_over_calls():
    metrics = MetricsAccumulator()
    metrics.add(
        {
            "loss": torch.tensor(1.0),
            "ratio/max": torch.tensor(2.0),
            "tv/mean": (torch.tensor(3.0), torch.tensor(3)),
        }
    )
    metrics.add(
        {
            "loss": torch.tensor(3.0),
            "ratio/max": torch.tensor(1.5),
            "tv/mean": (torch.tensor(0.0), torch.tensor(0)),
        }
    )
    metrics.add({"loss": 2.0, "tv/mean": (torch.tensor(1.0), torch.tensor(1)), "steps": 1})
    result = metrics.result()
    assert list(result) == ["loss", "ratio/max", "tv/mean", "steps"]
    assert result == {"loss": 2.0, "ratio/max": 2.0, "tv/mean": 1.0, "steps": 1.0}  # 4 over 4 items


def test_a_pair_that_never_counted_anything_is_zero():
    metrics = MetricsAccumulator()
    metrics.add({"tv/mean": (torch.tensor(0.0), torch.tensor(0))})
    assert metrics.result() == {"tv/mean": 0.0}
