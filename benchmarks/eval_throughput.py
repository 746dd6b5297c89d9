"""`grpoflow eval` throughput, the native engine against transformers' `generate` (the hf engine), in
one run; and the native engine's log-prob gap to the training forward in a few training steps.

    python benchmarks/eval_throughput.py            # Qwen2-0.5B-shaped random model, bf16, CUDA
    python benchmarks/eval_throughput.py --smoke    # the tiny model on the CPU, to check the script

Evaluation: packaged GSM8K test prompts (character tokens, so 150-600 tokens each), n samples per
prompt at temperature 1, up to max_completion_length new tokens (a random model rarely stops),
scored by the `format` reward; tokens/s counts sampled tokens over the whole evaluation (prefill,
sampling and scoring included). The gap: `sampling/sampling_logp_difference/{mean,max}`, the
absolute difference between the log-prob the engine sampled each token with and the trainer's
forward pass before the update, over a few GRPO steps on the echo task.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import tempfile
from pathlib import Path

import torch

from grpoflow.run.build import run
from grpoflow.run.config import GRPOConfig
from grpoflow.run.evaluate_model import evaluate_model


def eval_config(args: argparse.Namespace, engine: str, output: Path, prompts: int) -> GRPOConfig:
    return GRPOConfig.from_flat_dict(
        {
            "model": args.model,
            "torch_dtype": args.dtype,
            "rollout_engine": engine,
            "dataset": [f"gsm8k#{prompts}"],
            "eval_dataset": [f"gsm8k#{prompts}"],
            "reward_funcs": ["format"],
            "num_generations_eval": args.n,
            "max_completion_length": args.max_tokens,
            "max_prompt_length": 1024,
            "per_device_train_batch_size": args.n * args.prompts,
            "num_generations": args.n,
            "gpu_memory_utilization": 0.6,
            "output_dir": str(output / engine),
        }
    )


def release() -> None:
    """Free what the last measurement left on the GPU (its model and engine)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_eval(args: argparse.Namespace, engine: str, output: Path, prompts: int) -> dict:
    config = eval_config(args, engine, output, prompts)
    evaluate_model(config)  # warm-up (CUDA graphs, kernels, allocator)
    release()
    metrics = evaluate_model(config)
    release()
    return {
        "engine": engine,
        "prompts": int(metrics["eval/num_prompts"]),
        "samples_per_prompt": args.n,
        "mean_length": metrics["eval/completions/mean_length"],
        "seconds": metrics["eval/time"],
        "tokens_per_second": metrics["eval/tokens_per_second"],
    }


def measure_gap(args: argparse.Namespace, output: Path) -> dict:
    config = GRPOConfig.from_flat_dict(
        {
            "model": args.model,
            "torch_dtype": args.dtype,
            "dataset": ["echo"],
            "reward_funcs": ["echo"],
            "num_generations": 8,
            "per_device_train_batch_size": 32,
            "gradient_accumulation_steps": max(1, 8 * args.prompts // 32),
            "max_completion_length": args.max_tokens,
            "max_prompt_length": 16,
            "max_steps": args.gap_steps,
            "learning_rate": 1e-6,
            "beta": 0.0,
            "report_to": ["none"],
            "disable_tqdm": True,
            "save_steps": 10_000,
            "output_dir": str(output / "gap"),
        }
    )
    history = run(config)
    means = [step["sampling/sampling_logp_difference/mean"] for step in history]
    maxima = [step["sampling/sampling_logp_difference/max"] for step in history]
    return {"steps": len(history), "gap_mean": statistics.mean(means), "gap_max": max(maxima)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny model on the CPU")
    parser.add_argument("--prompts", type=int, default=64, help="eval prompts for the native engine")
    parser.add_argument("--hf-prompts", type=int, default=8, help="eval prompts for transformers")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--gap-steps", type=int, default=3)
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    args.model = "random:qwen2-0.5b" if cuda else "tiny"
    args.dtype = "bfloat16" if cuda else "float32"
    if args.smoke:
        args.prompts, args.hf_prompts, args.n, args.max_tokens, args.gap_steps = 4, 2, 2, 16, 2
    device = torch.cuda.get_device_name() if cuda else "cpu"
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch)
        native = measure_eval(args, "native", output, args.prompts)
        hf = measure_eval(args, "hf", output, args.hf_prompts)
        gap = measure_gap(args, output)
    report = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "model": args.model,
        "dtype": args.dtype,
        "eval": [native, hf],
        "speedup": native["tokens_per_second"] / hf["tokens_per_second"],
        "logprob_gap": gap,
    }
    name = f"{report['date']}-eval-throughput-{'smoke' if args.smoke else device.replace(' ', '_')}.json"
    path = Path(args.output) if args.output else Path(__file__).parent / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{device}, {args.model} in {args.dtype}; results in {path}")
    print(f"{'engine':<8} {'prompts x n':>12} {'mean len':>9} {'seconds':>9} {'tokens/s':>10}")
    for row in report["eval"]:
        shape = f"{row['prompts']} x {row['samples_per_prompt']}"
        print(
            f"{row['engine']:<8} {shape:>12} {row['mean_length']:>9.1f} {row['seconds']:>9.2f} "
            f"{row['tokens_per_second']:>10.0f}"
        )
    print(f"native / transformers: {report['speedup']:.1f}x tokens/s")
    print(
        f"native engine log-prob gap over {gap['steps']} steps: mean {gap['gap_mean']:.2e}, "
        f"max {gap['gap_max']:.2e} nats"
    )


if __name__ == "__main__":
    main()
