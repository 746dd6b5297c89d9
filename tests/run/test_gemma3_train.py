"""A Gemma 3 policy trained end to end: `grpoflow train` on a tiny random Gemma 3 text model (a
sliding window layer and a full attention one) on the CPU, generated on the native engine's family
path, its log-probs those of the update's forward and its reward rising."""

from __future__ import annotations

from helpers.support import recipe

from grpoflow.run.build import build_trainer, run


def test_a_tiny_gemma3_trains_on_the_family_path_and_its_reward_rises(tmp_path):
    config = recipe(
        tmp_path, model="random:tiny-gemma3", max_steps=8, per_device_train_batch_size=64, learning_rate=0.02
    )
    trainer = build_trainer(config)
    assert trainer.engine.path == "family"
    metrics = run(config, trainer)
    assert len(metrics) == 8
    for step in metrics:
        assert step["sampling/sampling_logp_difference/max"] < 1e-4 and step["weights/nonfinite"] == 0
    rewards = [step["reward"] for step in metrics]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > 3 * first and last > 0.05, rewards
