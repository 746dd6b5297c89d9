"""A run whose episodes all fail: counted as such, and stopped with the first error's message."""

from __future__ import annotations

from grpoflow import options
from grpoflow.cli import main, resolve_recipe
from grpoflow.run.build import run
from grpoflow.run.config import load_config
from grpoflow.run.health import HealthConfig, HealthMonitor

BROKEN = """
class Broken:
    def reset(self, **row):
        raise RuntimeError("the world is missing")

    def respond(self, text):
        return None

    def get_reward(self):
        return 0.0
"""


def flags(tmp_path, **values) -> list[str]:
    path = tmp_path / "broken.py"
    path.write_text(BROKEN)
    settings = {
        "environment_factory": f"{path}:Broken",
        "output_dir": str(tmp_path / "run"),
        "per_device_train_batch_size": 16,
        "report_to": "none",
        "disable_tqdm": "true",
        "html_report": "false",
        **values,
    }
    return [item for key, value in settings.items() for item in (f"--{key}", str(value))]


def test_failed_episodes_are_counted_warned_once_a_step_and_not_blamed_on_the_rewards(tmp_path, caplog):
    overrides = options.parse_overrides(flags(tmp_path, max_steps=1, max_consecutive_reward_failures=0))
    config = load_config(resolve_recipe("relay", overrides), overrides)
    (step,) = run(config)
    assert step["episodes/num_errors"] == 16 and step["episodes/failed_fraction"] == 1.0
    (warning,) = [
        record.getMessage() for record in caplog.records if "world is missing" in record.getMessage()
    ]
    assert warning.startswith("16 episodes: could not start: RuntimeError: the world is missing")
    monitor = HealthMonitor(HealthConfig(health_window=2))
    findings = [finding.check for index in (1, 2, 3) for finding in monitor.update(index, step)]
    assert "reward_errors" not in findings  # not the reward functions' fault


def test_a_run_whose_episodes_all_fail_stops_with_the_first_error(tmp_path, capsys):
    code = main(
        ["train", "--config", "relay", *flags(tmp_path, max_steps=6, max_consecutive_reward_failures=2)]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "stopped at step 2: every episode failed for 2 steps in a row" in err
    assert "first error: RuntimeError: the world is missing" in err
