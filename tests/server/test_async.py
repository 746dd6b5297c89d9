"""Asynchronous generation against `grpoflow serve`: the next batch generates during the update,
its staleness stays within max_staleness, and the importance-sampling correction is logged."""

from __future__ import annotations

import pytest
import torch
from helpers import support

from grpoflow.run.build import build_trainer, run


def _config(tmp_path, url, **overrides):
    return support.recipe(
        tmp_path,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        learning_rate=3e-3,
        **overrides,
    )


def test_async_training_keeps_staleness_in_bound_and_logs_the_correction(fresh, tmp_path):
    config = _config(tmp_path, fresh.url, max_steps=4, async_generate=True)
    trainer = build_trainer(config)
    try:
        history = run(config, trainer)
    finally:
        trainer.engine.close()
    assert [step["async/staleness"] for step in history] == [0.0, 1.0, 1.0, 1.0]
    for step in history:
        assert "time/rollout_wait" in step and step["completions/mean_length"] > 0
        assert (
            0
            < step["sampling/importance_sampling_ratio/min"]
            <= step["sampling/importance_sampling_ratio/max"]
        )
    # A batch one version old is sampled by other weights than the ones it trains: the gap shows.
    assert history[0]["sampling/sampling_logp_difference/max"] < 1e-3
    assert all(step["sampling/sampling_logp_difference/max"] > 1e-3 for step in history[1:])
    served = dict(fresh.service.model.named_parameters())
    for name, parameter in trainer.model.named_parameters():
        assert torch.equal(served[name], parameter.detach()), name


def test_a_checkpoint_taken_while_a_batch_is_prefetched_resumes_before_it(fresh, tmp_path):
    """The prefetched batch's prompts are not in the checkpoint: resuming generates them again, so
    the prompt order is the synchronous run's."""
    # Two trainers take turns on one server: checkpoint syncs (a collective group has one trainer).
    shared = {"max_steps": 4, "vllm_weight_transfer": "checkpoint"}
    asynchronous = build_trainer(_config(tmp_path / "a", fresh.url, async_generate=True, **shared))
    synchronous = build_trainer(_config(tmp_path / "s", fresh.url, **shared))
    try:
        for _ in range(2):
            asynchronous.step()
            synchronous.step()
        assert asynchronous.source.prefetcher.pending
        assert asynchronous.state_dict()["sampler"] == synchronous.state_dict()["sampler"]
        assert torch.equal(
            asynchronous.state_dict()["seed_generator"], synchronous.state_dict()["seed_generator"]
        )
    finally:
        asynchronous.source.prefetcher.close()
        asynchronous.engine.close()
        synchronous.engine.close()


def test_async_generate_needs_a_rollout_server(tmp_path):
    with pytest.raises(ValueError, match="vllm_mode: server"):
        build_trainer(support.recipe(tmp_path, async_generate=True))
