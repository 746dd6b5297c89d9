"""Weak (or strong) scaling of a GRPO step over 1, 2 and 4 GPUs, and the memory options, in one run.

    python benchmarks/scaling.py                          # a 2-GPU machine, the standard workload
    python benchmarks/scaling.py --variants 1gpu,2gpu-fsdp,2gpu-fsdp+keep-gathered+nccl-simple --steps 4
    python benchmarks/scaling.py --device cpu --model tiny   # two CPU processes, to check the script
    python benchmarks/scaling.py --model qwen2.5-7b --prompts 16 --micro-batch 16 --variants 1gpu,2gpu-fsdp
    python benchmarks/scaling.py --model qwen2.5-7b --strong --prompts 64 --micro-batch 16 \
        --variants 1gpu,4gpu-fsdp+keep-gathered+reduce-per-step     # 64 x 8 a step on 1 and on 4 GPUs
    python benchmarks/scaling.py --model qwen2.5-7b --strong --prompts 64 --defaults \
        --variants 1gpu,4gpu-fsdp     # the same, as grpoflow train chooses (the FSDP layout too)

The standard workload of benchmarks/grpo_step.py per GPU (a random Qwen2-0.5B-shaped model in bf16,
`--prompts` (64) prompts x 8 generations, prompt 128 tokens, 256 new tokens, beta 0, native engine,
gradient checkpointing; under `--defaults` the micro-batch, checkpointing, compile and FSDP layout
each variant's plan chooses, as `grpoflow train` does), so 2 GPUs generate and train on twice the
batch of 1 (weak scaling); with `--strong`, `--prompts` is the step's whole batch, split over
each variant's GPUs.
`--model qwen2.5-7b` trains a random Qwen2.5-7B-shaped model in full (bf16 weights, gradients and
AdamW state), built on each rank from the same seed. Each variant is one `grpoflow train`
under torchrun in its own subprocess; its numbers come from the run's metrics.jsonl (step time of
the slowest rank, peak memory of the fullest GPU) over the steps after `--warmup`. Scaling
efficiency is generated tokens per second per GPU over the whole step, against the 1-GPU run.
Each row also gives the memory plan's predicted peak per GPU (`grpoflow plan` for the variant's
config and number of processes) beside the measured one, and the update's model FLOPs utilisation
(6 x parameters x trained tokens per GPU-second, over the bf16 peak; `update_hw_mfu` counts what
the GPU ran instead: the gradient checkpointing recompute, 8 x, and under shared prompts each
group's prompt once).
Results go to benchmarks/results/ as JSON, with the GPU name and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from grpo_step import grpoflow_overrides  # noqa: E402
from step_inputs import write_inputs  # noqa: E402
from step_report import GROUP_SIZE, matmul_tflops, update_tokens  # noqa: E402

from grpoflow.policy.auto_settings import DEFAULT_MICRO_BATCH  # noqa: E402
from grpoflow.policy.memory_plan import GIB  # noqa: E402
from grpoflow.run.config import load_config  # noqa: E402
from grpoflow.run.infer_workers import free_port  # noqa: E402
from grpoflow.run.plan_check import model_shape, run_plan  # noqa: E402

RESULTS = Path(__file__).parent / "results"
BASES: dict[str, tuple[int, dict]] = {
    "1gpu": (1, {}),
    "2gpu-ddp": (2, {}),
    "2gpu-fsdp": (2, {"fsdp": True}),
    "4gpu-ddp": (4, {}),
    "4gpu-fsdp": (4, {"fsdp": True}),
}
"""Variant base -> (processes, config keys on top of the standard workload)."""
OPTIONS: dict[str, dict] = {
    "reduce-per-step": {"fsdp_reduce_every_micro_batch": False},
    "keep-gathered": {"fsdp_reshard_after_forward": False},
    "bf16-reduce": {"fsdp_mixed_precision": "no"},
    "lora": {"train_type": "lora", "learning_rate": 1e-5},
    "offload-optimizer": {"offload_optimizer": True, "gc_collect_after_offload": True},
    "kl": {"beta": 0.04},
    "offload-model": {"offload_model": True, "gc_collect_after_offload": True},
    "keep-cache": {"sleep_level": 0},
}
"""Options a variant adds to its base, `+`-joined: `2gpu-fsdp+keep-gathered+reduce-per-step`.
`bf16-reduce` reduce-scatters the gradients in the weights' dtype (bf16 here) rather than float32."""
ENVIRONMENTS: dict[str, dict[str, str]] = {
    "nccl-simple": {"NCCL_PROTO": "Simple"},
    "expandable-segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "nccl-high-priority": {"TORCH_NCCL_HIGH_PRIORITY": "1"},
}
"""Options that set the processes' environment rather than the config."""
DEFAULT_VARIANTS = "1gpu,2gpu-ddp,2gpu-fsdp,1gpu+lora,1gpu+offload-optimizer,1gpu+kl,1gpu+kl+offload-model"


def parse_variant(name: str) -> tuple[int, dict, dict[str, str]]:
    """A variant's processes, config keys and environment; SystemExit naming what is unknown."""
    base, *options = name.split("+")
    unknown = [part for part in options if part not in OPTIONS and part not in ENVIRONMENTS]
    if base not in BASES or unknown:
        raise SystemExit(
            f"unknown variant {name!r}: a base of {', '.join(BASES)}, then +options of "
            f"{', '.join([*OPTIONS, *ENVIRONMENTS])}"
        )
    nproc, keys = BASES[base]
    keys, env = dict(keys), {}
    for part in options:
        keys.update(OPTIONS.get(part, {}))
        env.update(ENVIRONMENTS.get(part, {}))
    return nproc, keys, env


def variant_config(args, name: str, model_dir: Path, prompts: Path, workdir: Path) -> dict:
    """The run's config: grpo_step.py's workload per rank, the variant's keys, the device."""
    fixed = not args.defaults
    settings = argparse.Namespace(
        micro_batch=args.micro_batch if fixed else None,
        new_tokens=args.new_tokens,
        max_tokens=0,
        set=args.set,
        gradient_checkpointing=1 if fixed else None,
        torch_compile=0 if fixed else None,
        steps=args.steps,
        engine="native",
        workdir=str(workdir / name),
    )
    config = {
        **grpoflow_overrides(settings, model_dir, prompts),
        **parse_variant(name)[1],
        "device": args.device,
    }
    if args.model not in ("tiny", "qwen2-0.5b"):  # built on each rank, nothing written
        config["model"] = f"random:{args.model}"
    completions = rank_prompts(args, name) * GROUP_SIZE
    if fixed:
        micro_batch = min(16 if args.model == "tiny" else args.micro_batch, completions)
        config["per_device_train_batch_size"] = micro_batch
    else:  # the generation batch at the default micro-batch; the plan sizes the micro-batch
        micro_batch = DEFAULT_MICRO_BATCH
    config["gradient_accumulation_steps"] = completions // micro_batch
    config["max_steps"] = args.steps  # grpo_step's overrides plan for a long run it steps itself
    config["save_strategy"] = "no"  # steps only: a 7B checkpoint takes longer than several steps
    if args.model == "tiny":  # small enough for two CPU processes
        config["gpu_memory_utilization"] = 0.1
    return config


def run_variant(args, name: str, config: dict, workdir: Path) -> list[dict]:
    """Train the variant (its `config`) under torchrun; its metrics.jsonl rows."""
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    nproc, _, variant_env = parse_variant(name)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    command += ["--master_port", str(free_port()), "-m", "grpoflow.cli", "train", "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **variant_env}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NPROC_PER_NODE", "NNODES"):
        env.pop(key, None)
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"variant {name} failed:\n{(result.stdout + result.stderr)[-6000:]}")
    metrics = Path(config["output_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def chosen_settings(config: dict) -> dict:
    """The settings the variant's run trained with, by name (run.json's chosen_settings)."""
    path = Path(config["output_dir"]) / "run.json"
    chosen = json.loads(path.read_text()).get("chosen_settings", {}) if path.exists() else {}
    return {name: entry["value"] for name, entry in chosen.items()}


def as_run(config: dict, chosen: dict) -> dict:
    """`config` with the settings its run chose that its memory plan depends on (under --defaults
    the config leaves them unset), its generation batch kept."""
    micro_batch = config.get("per_device_train_batch_size", DEFAULT_MICRO_BATCH)
    completions = micro_batch * config["gradient_accumulation_steps"]
    planned = (
        "per_device_train_batch_size",
        "gradient_checkpointing",
        "shared_prompts",
        "use_liger_kernel",
        "sleep_level",
        "fsdp_reshard_after_forward",
        "fsdp_reduce_every_micro_batch",
    )
    settled = {**config, **{key: chosen[key] for key in planned if chosen.get(key) is not None}}
    settled["gradient_accumulation_steps"] = completions // settled.get(
        "per_device_train_batch_size", DEFAULT_MICRO_BATCH
    )
    return settled


def predicted_peak(config: dict, nproc: int) -> tuple[float, int]:
    """The memory plan's peak per GPU (GiB) for the variant's config over `nproc` processes, and
    the parameters a token multiplies by (an untied input embedding is a lookup)."""
    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(nproc)
    try:
        loaded = load_config(None, config)
        plan, _ = run_plan(loaded, torch.cuda.get_device_properties(0).total_memory)
        shape = model_shape(loaded, on_gpu=True)
        embedding = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
        return plan.peak / GIB, shape.num_active_parameters() - embedding
    finally:
        if previous is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = previous


def summarize(args, name: str, rows: list[dict], config: dict) -> dict:
    """The variant's steady-state means (steps after --warmup), its peak against the plan's, MFU."""
    nproc = parse_variant(name)[0]
    steady = rows[args.warmup :] or rows

    def mean(key: str) -> float | None:
        values = [row[key] for row in steady if row.get(key) is not None]
        return sum(values) / len(values) if values else None

    step_s, update_s, mean_length = mean("time/step"), mean("time/update"), mean("completions/mean_length")
    generations = rank_prompts(args, name) * GROUP_SIZE
    peaks = [row["memory/max_allocated_gib"] for row in rows if "memory/max_allocated_gib" in row]
    row = {
        "variant": name,
        "gpus": nproc,
        "seconds_per_step": step_s,
        "rollout_s": mean("time/rollout"),
        "update_s": update_s,
        "generated_tokens_per_s_per_gpu": generations * mean_length / step_s,
        "rollout_tokens_per_s_per_gpu": mean("tokens_per_second/rollout") / nproc,
        "peak_gib_per_gpu": max(peaks) if peaks else None,
        "predicted_gib_per_gpu": None,
        "update_mfu": None,
        "update_hw_mfu": None,
        "settings": chosen_settings(config),
        "phases_s": {
            key.removeprefix("time/"): mean(key)
            for key in steady[0]
            if key.startswith("time/") and not key.startswith("time/background")
        },
    }
    tflops = matmul_tflops(_device_name(args))
    if args.device == "cuda":
        row["predicted_gib_per_gpu"], num_params = predicted_peak(as_run(config, row["settings"]), nproc)
        shared = bool(row["settings"].get("shared_prompts"))  # each group's prompt through the update once
        trained, executed = update_tokens(generations, mean_length, shared)  # per GPU
        if tflops and config.get("train_type", "full") == "full":
            row["update_mfu"] = 6 * num_params * trained / update_s / (tflops * 1e12)
            recompute = 8 / 6 if row["settings"].get("gradient_checkpointing") else 1.0
            row["update_hw_mfu"] = row["update_mfu"] * recompute * executed / trained
    return row


def rank_prompts(args, name: str) -> int:
    """Prompts each GPU of the variant generates for a step: `--prompts`, or under `--strong` its
    share of them."""
    nproc = parse_variant(name)[0]
    if not args.strong:
        return args.prompts
    if args.prompts % nproc:
        raise SystemExit(
            f"--strong splits --prompts {args.prompts} over {nproc} GPUs ({name}): give a multiple"
        )
    return args.prompts // nproc


def _device_name(args) -> str:
    return torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"


def add_efficiency(rows: list[dict]) -> None:
    """Each multi-GPU row's generated tokens per second per GPU against the 1-GPU row's."""
    base = next((row for row in rows if row["variant"] == "1gpu" and "error" not in row), None)
    for row in rows:
        if "error" not in row:
            scaled = base is not None and row["gpus"] > 1
            per_gpu = row["generated_tokens_per_s_per_gpu"]
            row["scaling_efficiency"] = per_gpu / base["generated_tokens_per_s_per_gpu"] if scaled else None


def print_table(rows: list[dict]) -> None:
    """The rows' numbers as a table, then each row's settings and phases."""
    first = next((row for row in rows if "error" not in row), rows[0])
    keys = [key for key in first if not isinstance(first[key], dict)]
    print(" | ".join(keys))
    for row in rows:
        if "error" in row:
            print(f"{row['variant']} | {row['gpus']} | failed: {row['error'].strip().splitlines()[-1]}")
            continue
        cells = [f"{row[key]:.3g}" if isinstance(row[key], float) else str(row[key] or "-") for key in keys]
        print(" | ".join(cells))
    for row in rows:
        if "error" not in row:
            phases = ", ".join(
                f"{name} {seconds:.3f}" for name, seconds in row["phases_s"].items() if seconds
            )
            print(f"{row['variant']}: {row['settings']}\n  seconds: {phases}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"comma-separated; each a base of {', '.join(BASES)}, then +options of "
        f"{', '.join([*OPTIONS, *ENVIRONMENTS])}",
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=None, help="per GPU and step (64; tiny: 4)")
    parser.add_argument(
        "--strong", action="store_true", help="--prompts is the whole step's, split over the GPUs"
    )
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="leave micro-batch, gradient checkpointing and torch_compile to each variant's plan, "
        "as grpoflow train does (else: --micro-batch, checkpointing on, compile off)",
    )
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--set", action="append", default=[], help="config KEY=VALUE, every variant")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", choices=("qwen2-0.5b", "qwen2.5-7b", "tiny"), default="qwen2-0.5b")
    parser.add_argument(
        "--out", default=None, help="JSON path (default: benchmarks/results/DATE-scaling-GPU.json)"
    )
    args = parser.parse_args()
    names = [name for name in args.variants.split(",") if name]
    if args.prompts is None:
        args.prompts = 4 if args.model == "tiny" else 64
    for name in names:
        rank_prompts(args, name)  # checks the variant, and the split under --strong
    if args.device == "cuda":
        visible = torch.cuda.device_count()
        skipped = [name for name in names if parse_variant(name)[0] > visible]
        if skipped:
            print(f"skipping {skipped}: {visible} GPU(s) visible")
        names = [name for name in names if name not in skipped]
    device_name = _device_name(args)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir, prompts = write_inputs(
            workdir, args.model != "qwen2-0.5b", num_prompts=args.prompts * 2 * args.steps
        )
        today = datetime.date.today().isoformat()
        out = (
            Path(args.out) if args.out else RESULTS / f"{today}-scaling-{device_name.replace(' ', '_')}.json"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "date": today,
            "device": device_name,
            "torch": torch.__version__,
            "defaults": args.defaults,
            "args": vars(args),
        }
        results, rows = {}, []
        for name in names:
            print(f"running {name} ...", flush=True)
            started = time.perf_counter()
            config = variant_config(args, name, model_dir, prompts, workdir)
            try:
                results[name] = run_variant(args, name, config, workdir)
            except RuntimeError as error:  # one variant out of memory: the others still run
                print(error, flush=True)
                rows.append({"variant": name, "gpus": parse_variant(name)[0], "error": str(error)[-2000:]})
                continue
            rows.append(summarize(args, name, results[name], config))
            print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
            add_efficiency(rows)
            out.write_text(json.dumps({**record, "rows": rows, "steps": results}, indent=1))
    print_table(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
