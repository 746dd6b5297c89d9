"""The memory plan's prediction against the measured peak, on one CUDA GPU.

Runs a few real GRPO steps through grpoflow's trainer (native engine) for
(a) a random Qwen2.5-0.5B-shaped model, full fine-tuning, and (b) a random Qwen2.5-7B-shaped
model with LoRA rank 16 on every linear layer and gradient checkpointing, (c) the same for a random
Qwen3-30B-A3B shape cut to 8 layers (a mixture of experts); records
torch.cuda.max_memory_allocated and max_memory_reserved and compares them with the plan's peak.
Every sequence has the lengths the plan assumes: prompts are cut on the left to exactly
max_prompt_length tokens, and a random model's completions run to max_completion_length (its end
token is one of ~152K). Prints a table and saves benchmarks/results/DATE-memory-plan-GPUNAME.json.

    python benchmarks/memory_plan.py [--cases qwen3-30b-a3b-8l-lora]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpoflow.phases import PhaseTimer
from grpoflow.policy.memory_plan import GIB
from grpoflow.run.build import run
from grpoflow.run.config import load_config
from grpoflow.run.plan_check import gpu_capacity, run_plan

RECIPE = Path(__file__).resolve().parents[1] / "grpoflow" / "recipes" / "default.yaml"
COMMON = {
    "reward_funcs": [f"{Path(__file__).resolve()}:reward_length"],
    "truncation_strategy": "left",
    "dataset_shuffle": False,
    "torch_dtype": "bfloat16",
    "max_steps": 3,
    "num_generations": 8,
    "max_prompt_length": 128,
    "max_completion_length": 256,
    "report_to": ["none"],
    "disable_tqdm": True,
    "html_report": False,
    "save_steps": 1000,
}
CASES = {
    "qwen2.5-0.5b-full": {"model": "random:qwen2-0.5b", "per_device_train_batch_size": 32},
    "qwen2.5-7b-lora": {
        "model": "random:qwen2.5-7b",
        "train_type": "lora",
        "lora_rank": 16,
        "target_modules": ["all-linear"],
        "gradient_checkpointing": True,
        "per_device_train_batch_size": 16,
    },
    "qwen3-30b-a3b-8l-lora": {  # a mixture of experts under checkpointing
        "model": "random:qwen3-30b-a3b-8l",
        "train_type": "lora",
        "lora_rank": 16,
        "target_modules": ["all-linear"],
        "gradient_checkpointing": True,
        "per_device_train_batch_size": 64,
    },
}


def reward_length(completions, **kwargs):
    """A cheap reward with spread."""
    return [len(text) / 1000 for text in completions]


def write_prompts(path: Path, count: int) -> Path:
    """Prompts far longer than max_prompt_length tokens (cut to it on the left)."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    with open(path, "w") as handle:
        for index in range(count):
            text = " ".join(words[(index * 7 + k * 3) % len(words)] for k in range(400))
            handle.write(json.dumps({"prompt": text}) + "\n")
    return path


@dataclass
class PhasePeaks:
    """The largest allocation of each phase, and the allocator's largest reservation overall."""

    allocated: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    reserved: int = 0


@contextmanager
def phase_peaks():
    """Within the block, the peaks of grpoflow's steps (`PhasePeaks`): each stretch between two
    phase edges is charged to the innermost phase open in it. Each edge resets the allocator's
    peaks, so the reservation's is kept here too."""
    peaks = PhasePeaks()
    open_phases: list[str] = []
    timed = PhaseTimer.__call__

    def edge() -> None:
        name = open_phases[-1] if open_phases else "(between phases)"
        peaks.allocated[name] = max(peaks.allocated[name], torch.cuda.max_memory_allocated())
        peaks.reserved = max(peaks.reserved, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    @contextmanager
    def call(timer: PhaseTimer, name: str):
        edge()
        open_phases.append(name)
        try:
            with timed(timer, name):
                yield
        finally:
            edge()
            open_phases.pop()

    PhaseTimer.__call__ = call
    try:
        yield peaks
    finally:
        PhaseTimer.__call__ = timed
        edge()  # what ran after the last phase


def measure(name: str, overrides: dict) -> dict:
    with tempfile.TemporaryDirectory() as output_dir:
        prompts = write_prompts(Path(output_dir) / "prompts.jsonl", 256)
        values = {**COMMON, **overrides, "output_dir": output_dir, "dataset": str(prompts)}
        config = load_config(RECIPE, values)
        plan, blocks = run_plan(config, gpu_capacity(config))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with phase_peaks() as peaks:
            history = run(config)
    reserved = peaks.reserved / GIB
    allocated = max(peaks.allocated.values(), default=0) / GIB
    predicted = plan.peak / GIB
    return {
        "case": name,
        "predicted_gib": round(predicted, 3),
        "measured_allocated_gib": round(allocated, 3),
        "measured_reserved_gib": round(reserved, 3),
        "error_pct": round(100 * (predicted - allocated) / allocated, 1),
        "peak_phase": plan.peak_phase,
        "parts_gib": {
            phase: {k: round(v / GIB, 3) for k, v in parts.items()}
            for phase, parts in (("rollout", plan.rollout), ("update", plan.update))
        },
        "kv_blocks": blocks,
        "measured_peak_by_phase_gib": {
            phase: round(peak / GIB, 3) for phase, peak in sorted(peaks.allocated.items())
        },
        "seconds_per_step": round(sum(step["time/step"] for step in history) / len(history), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    names = parser.parse_args().cases.split(",")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    if not torch.cuda.is_available():
        print("memory_plan.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [measure(name, CASES[name]) for name in names]
    print(f"{'case':<24} {'predicted':>10} {'allocated':>10} {'reserved':>10} {'error %':>8}")
    for row in rows:
        print(
            f"{row['case']:<24} {row['predicted_gib']:>10.2f} {row['measured_allocated_gib']:>10.2f} "
            f"{row['measured_reserved_gib']:>10.2f} {row['error_pct']:>8.1f}"
        )
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    path = Path(__file__).parent / "results" / f"{datetime.date.today()}-memory-plan-{gpu}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
