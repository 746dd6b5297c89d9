"""A TRL-shaped GRPO script, with only the import changed, under `torchrun --nproc_per_node 2` on
the CPU (gloo): data-parallel and FSDP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers.support import clean_env, free_port
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow

SCRIPT = """
import json
import os
import sys

from datasets import Dataset
from transformers import TrainerCallback

from grpoflow import GRPOConfig, GRPOTrainer

model_dir, output_dir, fsdp = sys.argv[1], sys.argv[2], sys.argv[3] == "fsdp"


class StopOnRankZero(TrainerCallback):
    # Records state.is_world_process_zero at each step; asks to stop after step 2 on rank 0 alone.
    def __init__(self):
        self.world_zero = []

    def on_step_end(self, args, state, control, **kwargs):
        self.world_zero.append(state.is_world_process_zero)
        if state.is_world_process_zero and state.global_step == 2:
            control.should_training_stop = True


def reward_vowels(completions, **kwargs):
    return [float(sum(char in "aeiou" for char in completion)) for completion in completions]


args = GRPOConfig(
    output_dir=output_dir,
    learning_rate=1e-2,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=4,
    max_steps=3,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    fsdp=fsdp,
    html_report=False,
    disable_tqdm=True,
)
callback = StopOnRankZero()
trainer = GRPOTrainer(
    model=model_dir,
    reward_funcs=reward_vowels,
    args=args,
    train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"]}),
    callbacks=[callback],
)
trainer.train()
trainer.save_model(os.path.join(output_dir, "final"))
seen = {
    "world_zero": callback.world_zero,
    "logged_steps": [entry["step"] for entry in trainer.state.log_history],
    "global_step": trainer.state.global_step,
}
with open(os.path.join(output_dir, "rank{}.json".format(os.environ["RANK"])), "w") as file:
    json.dump(seen, file)
"""
"""Trains 2 of its 3 steps (a callback on rank 0 stops it), then saves the model."""


def run_for_at_most(command: list[str], seconds: float) -> tuple[int | None, str]:
    """Run `command` in a process group of its own; past `seconds`, kill the group (torchrun and
    its workers): the exit status (None when killed) and the output."""
    process = subprocess.Popen(
        command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, f"{output}\nkilled after {seconds} s"
    return process.returncode, output


@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_a_trl_script_trains_and_saves_under_torchrun(tmp_path, tiny_model_dir, layout):
    script = tmp_path / "train_grpo.py"
    script.write_text(SCRIPT)
    output_dir = tmp_path / "out"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), str(script), str(tiny_model_dir), str(output_dir), layout,
    ]  # fmt: skip
    returncode, output = run_for_at_most(command, seconds=180)
    assert returncode == 0, output[-4000:]

    ranks = [json.loads((output_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["world_zero"] == [True, True] and ranks[1]["world_zero"] == [False, False]
    assert [seen["global_step"] for seen in ranks] == [2, 2]  # rank 0's stop stopped both
    assert ranks[0]["logged_steps"] == [1, 2]
    assert sorted(path.name for path in output_dir.iterdir() if path.is_dir()) == ["final"]
    saved = AutoModelForCausalLM.from_pretrained(output_dir / "final").state_dict()
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert saved.keys() == start.keys()
    assert any(not torch.equal(saved[name], start[name]) for name in saved)  # the trained weights
