"""A GRPO step with LoRA on a 7B shape, on one CUDA GPU: step time, every phase, the update's
achieved FLOP/s and the rollout's tokens/s.

    python benchmarks/lora_step.py                  # the 7B workload (about 4 minutes on an H100)
    python benchmarks/lora_step.py --smoke          # a tiny model on the CPU, to check the script
    python benchmarks/lora_step.py --set lora_dropout=0 --set gradient_checkpointing=false --micro-batch 4
    python benchmarks/lora_step.py --profile        # then the top GPU operators of one more step

The workload: a random-initialised Qwen2.5-7B-shaped model in bf16, LoRA rank 16 (alpha 32) on
every linear layer, gradient checkpointing, 16 prompts x 8 completions of 256 new tokens (prompts
of 128 random characters, which the character tokenizer maps to 128 tokens), beta 0, one optimizer
step per batch, the native engine. The first `--warmup` steps are left out of the means.

FLOPs the update really does, for T trained tokens (prompt and completion of every sequence),
N the base's parameters in matrix products (every linear layer and the output head; not the
embedding lookup) and N_a the adapters' parameters:

    forward                        2 N T + 2 N_a T
    backward, activation grads     2 N T + 2 N_a T   (the frozen base gets no weight gradient)
    backward, adapter weight grads          2 N_a T
    total                          4 N T + 6 N_a T   (attention's T^2 terms left out)

Gradient checkpointing runs each layer's forward again in the backward pass: `hardware` counts
that recomputation too (6 N T + 8 N_a T), `model` does not. Both are divided by the update phase's
seconds and by the GPU's dense bf16 peak (989 TFLOP/s for an H100 SXM). Results go to
benchmarks/results/DATE-lora-step-GPU.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from grpo_step import extra_overrides

RESULTS = Path(__file__).parent / "results"
BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
NUM_PROMPTS, NUM_GENERATIONS, PROMPT_TOKENS = 16, 8, 128


def write_prompts(path: Path, count: int) -> Path:
    rng = random.Random(0)
    with open(path, "w") as handle:
        for _ in range(count):
            handle.write(
                json.dumps({"prompt": "".join(rng.choice("abcdefghij") for _ in range(PROMPT_TOKENS))})
            )
            handle.write("\n")
    return path


def reward_length(completions, **kwargs):
    """A cheap reward with spread: the completion's length in characters, scaled."""
    return [len(text) / 256 for text in completions]


def overrides(args, workdir: Path) -> dict:
    completions = NUM_PROMPTS * NUM_GENERATIONS
    return {
        "model": "tiny" if args.smoke else "random:qwen2.5-7b",
        "torch_dtype": "bfloat16",
        "dataset": str(write_prompts(workdir / "prompts.jsonl", NUM_PROMPTS * (args.steps + 1))),
        "reward_funcs": [f"{Path(__file__).resolve()}:reward_length"],
        "train_type": "lora",
        "lora_rank": args.rank,
        "lora_alpha": 2 * args.rank,
        "target_modules": ["all-linear"],
        "gradient_checkpointing": True,
        "num_generations": NUM_GENERATIONS,
        "per_device_train_batch_size": args.micro_batch,
        "gradient_accumulation_steps": completions // args.micro_batch,
        "max_prompt_length": PROMPT_TOKENS,
        "max_completion_length": args.new_tokens,
        "beta": 0.0,
        "learning_rate": 1e-5,
        "max_steps": args.steps,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "output_dir": str(workdir / "run"),
        "save_steps": 10_000,
        "report_to": ["none"],
        "disable_tqdm": True,
        "html_report": False,
        "dataset_shuffle": False,
        **extra_overrides(args.set),
    }


def matmul_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(N, N_a): the base's parameters in matrix products (every 2-D weight but the embedding
    table) and the adapters' parameters."""
    embedding = model.get_input_embeddings().weight
    base = adapters = 0
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            adapters += parameter.numel()
        elif parameter.dim() == 2 and parameter is not embedding:
            base += parameter.numel()
    return base, adapters


def summarize(steps: list[dict], base: int, adapters: int, peak_tflops: float | None) -> dict:
    def mean(key: str) -> float:
        values = [step.get(key, 0.0) for step in steps]
        return sum(values) / len(values)

    phases = sorted({key for step in steps for key in step if key.startswith("time/")})
    row = {key: mean(key) for key in phases}
    sequences = NUM_PROMPTS * NUM_GENERATIONS
    generated = mean("completions/mean_length")
    tokens = sequences * (PROMPT_TOKENS + generated)
    flops = {"model": (4 * base + 6 * adapters) * tokens, "hardware": (6 * base + 8 * adapters) * tokens}
    update = row.get("time/update", 0.0)
    for kind, count in flops.items():
        row[f"update_tflops_{kind}"] = count / update / 1e12 if update else 0.0
        if peak_tflops:
            row[f"update_mfu_{kind}"] = row[f"update_tflops_{kind}"] / peak_tflops
    row["rollout_tokens_per_s"] = (
        sequences * generated / row["time/rollout"] if row.get("time/rollout") else 0.0
    )
    row["generated_tokens_mean"] = generated
    row["trained_tokens"] = tokens
    return row


def profile_step(trainer) -> None:
    """One more step under torch.profiler: its phases and the operators that took the most GPU
    (else CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        metrics = trainer.step()
    print({key: round(value, 3) for key, value in metrics.items() if key.startswith("time/")})
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(profiler.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70))


def print_table(row: dict) -> None:
    width = max(map(len, row))
    for key, value in row.items():
        print(f"{key:<{width}}  {value:12.4f}" if isinstance(value, float) else f"{key:<{width}}  {value}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--set", action="append", default=[], help="grpoflow config KEY=VALUE")
    parser.add_argument(
        "--profile", action="store_true", help="profile one more step, print its top operators"
    )
    parser.add_argument("--tag", default="", help="added to the results file's name")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if not (args.smoke or torch.cuda.is_available()):
        print("lora_step.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    if args.smoke:
        args.steps, args.warmup, args.new_tokens, args.micro_batch = 2, 1, 16, 32
    from grpoflow.run.build import build_trainer
    from grpoflow.run.config import load_config

    with tempfile.TemporaryDirectory(prefix="lora_step_") as workdir:
        config = load_config(None, overrides(args, Path(workdir)))
        trainer = build_trainer(config)
        base, adapters = matmul_parameters(trainer.model)
        steps = []
        for index in range(args.steps):
            start = time.perf_counter()
            metrics = trainer.step()
            metrics["time/wall"] = time.perf_counter() - start
            print(f"step {index}: {metrics['time/wall']:.2f} s", flush=True)
            steps.append(metrics)
        if args.profile:
            profile_step(trainer)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = next((value for key, value in BF16_PEAK_TFLOPS.items() if key in gpu), None)
    row = summarize(steps[args.warmup :] or steps, base, adapters, peak)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    print_table(row)
    date = datetime.date.today().isoformat()
    record = {"gpu": gpu, "date": date, "base_params": base, "adapter_params": adapters, "args": vars(args)}
    record["bf16_peak_tflops"], record["row"] = peak, row
    tag = "".join(f"-{part}" for part in (args.tag, "smoke" if args.smoke else "") if part)
    out = RESULTS / f"{date}-lora-step-{gpu.replace(' ', '_')}{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=float))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
