"""TRL scripts that evaluate, stop early and resume, with only the import changed, on a tiny local
model on the CPU; and `grpoflow train`'s run through the same trainer."""

from __future__ import annotations

from datasets import Dataset
from transformers import EarlyStoppingCallback, PrinterCallback, ProgressCallback, TrainerCallback

from grpoflow import GRPOConfig, GRPOTrainer
from grpoflow.run.config import load_config

TRL_ARGS = dict(
    learning_rate=1e-3,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=4,
    max_steps=2,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    disable_tqdm=True,
    seed=0,
    html_report=False,
)
"""Four prompts, two per step: an epoch is two steps."""


def letters(*prompts: str) -> Dataset:
    return Dataset.from_dict({"prompt": list(prompts), "letter": [prompt[0] for prompt in prompts]})


def reward_letter(completions, letter, **kwargs):
    return [float(completion.startswith(target)) for completion, target in zip(completions, letter)]


def reward_one(completions, **kwargs):
    return [1.0 for _ in completions]


class Recorder(TrainerCallback):
    """The hooks called in order, with the metrics of on_evaluate and the epoch at each step end."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.evaluations: list[dict] = []
        self.epochs: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append("on_step_begin")

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append("on_step_end")
        self.epochs.append(state.epoch)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append("on_evaluate")
        self.evaluations.append(dict(metrics))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append("on_log")


def test_evaluate_before_and_after_training_returns_logs_and_reports_eval_metrics(tmp_path, tiny_model_dir):
    recorder = Recorder()
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_letter,
        args=GRPOConfig(output_dir=str(tmp_path / "out"), **TRL_ARGS),
        train_dataset=letters("ab", "cd", "ef", "gh"),
        eval_dataset=letters("ab", "cd", "ef"),
        callbacks=[recorder],
    )
    before = trainer.evaluate()
    assert {"eval_reward", "eval_rewards/reward_letter/mean", "eval_pass@1", "eval_pass@2"} <= set(before)
    assert before["eval_num_prompts"] == 3 and not any("/" in key.split("_")[0] for key in before)
    assert trainer.state.log_history == [
        {**before, "step": 0}
    ]  # no epoch before training, as in transformers
    assert recorder.events == ["on_log", "on_evaluate"] and recorder.evaluations == [before]

    trainer.train()
    after = trainer.evaluate(eval_dataset=letters("ij"), metric_key_prefix="test")
    assert after["test_num_prompts"] == 1 and "test_reward" in after
    assert after["epoch"] == 1.0 and trainer.state.log_history[-1] == {**after, "step": 2}
    assert recorder.evaluations[-1] == after


def test_periodic_evaluation_steps_and_epochs_follow_transformers(tmp_path, tiny_model_dir, capsys):
    recorder = Recorder()
    args = GRPOConfig(output_dir=str(tmp_path / "out"), eval_strategy="steps", eval_steps=1, **TRL_ARGS)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_letter,
        args=args,
        train_dataset=letters("ab", "cd", "ef", "gh"),
        eval_dataset=letters("ab", "cd"),
        callbacks=[recorder, PrinterCallback, ProgressCallback],
    )
    trainer.train()

    step = ["on_step_begin", "on_log", "on_log", "on_evaluate", "on_step_end"]
    assert recorder.events == step * 2
    assert recorder.epochs == [0.5, 1.0] and trainer.state.epoch == 1.0
    assert [entry["step"] for entry in trainer.state.log_history] == [1, 1, 2, 2]
    trained, evaluated = trainer.state.log_history[:2]
    assert "loss" in trained and not any(key.startswith("eval") for key in trained)
    assert set(evaluated) == {*recorder.evaluations[0], "epoch", "step"} and "eval_reward" in evaluated
    assert evaluated["epoch"] == 0.5 and trainer.state.is_world_process_zero
    assert "'eval_reward'" in capsys.readouterr().out  # PrinterCallback printed the eval logs


def test_early_stopping_stops_the_run_when_eval_reward_stops_improving(tmp_path, tiny_model_dir):
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        eval_strategy="steps",
        eval_steps=1,
        metric_for_best_model="eval_reward",
        load_best_model_at_end=True,
        **{**TRL_ARGS, "max_steps": 5},
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_one,  # the same eval reward at every evaluation: no improvement
        args=args,
        train_dataset=letters("ab", "cd", "ef", "gh"),
        eval_dataset=letters("ab"),
        callbacks=[EarlyStoppingCallback(early_stopping_patience=2)],
    )
    assert args.metric_for_best_model == "eval_reward" and args.greater_is_better is True
    trainer.train()

    assert trainer.state.global_step == 3  # best at step 1, then two evaluations without improvement
    assert trainer.state.best_metric == 1.0 and trainer.state.best_global_step == 1
    assert (tmp_path / "out" / "checkpoint-best").is_dir()


def test_resume_from_checkpoint_true_continues_from_the_latest(tmp_path, tiny_model_dir):
    def trainer_for(max_steps: int, recorder: Recorder) -> GRPOTrainer:
        args = GRPOConfig(
            output_dir=str(tmp_path / "out"),
            **{**TRL_ARGS, "max_steps": max_steps, "save_strategy": "steps"},
            save_steps=1,
        )
        return GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=reward_letter,
            args=args,
            train_dataset=letters("ab", "cd", "ef", "gh"),
            callbacks=[recorder],
        )

    trainer_for(2, Recorder()).train()
    recorder = Recorder()
    resumed = trainer_for(3, recorder)
    resumed.train(resume_from_checkpoint=True)

    assert recorder.events.count("on_step_end") == 1 and recorder.epochs == [1.5]
    assert resumed.state.global_step == 3 and resumed.model is not None
    assert [entry["step"] for entry in resumed.state.log_history] == [1, 2, 3]  # the run's whole history
    assert (tmp_path / "out" / "checkpoint-3").is_dir()


def test_a_run_config_trains_through_the_api_trainer(tmp_path, tiny_model_dir):
    recorder = Recorder()
    config = load_config(
        None,
        {
            "model": tiny_model_dir,
            "dataset": "echo",
            "reward_funcs": ["echo"],
            "output_dir": str(tmp_path / "out"),
            "max_steps": 2,
            "num_generations": 2,
            "per_device_train_batch_size": 4,
            "max_completion_length": 4,
            "device": "cpu",
            "report_to": ["none"],
            "html_report": False,
            "disable_tqdm": True,
        },
    )
    trainer = GRPOTrainer.from_run_config(config, callbacks=[recorder])
    assert trainer.config is config and trainer.args.logging_steps == 1
    trainer.train()

    assert len(trainer.run_history) == 2 and trainer.state.global_step == 2
    assert recorder.events.count("on_step_begin") == 2 and recorder.events.count("on_log") == 2
