"""Profile one GRPO step of grpoflow on the standard workload and print where the time goes.

    python benchmarks/profile_step.py [--micro-batch 32] [--gradient-checkpointing 1] [--workload long-tail]
    torchrun --nproc_per_node 2 benchmarks/profile_step.py --smoke --set model=random:qwen2.5-7b \
        --set fsdp=true --micro-batch 16 --set gradient_accumulation_steps=8   # rank 0 prints

Runs one warm-up step, then one step under torch.profiler; prints the top operators by GPU time
and by CPU time, and writes a Chrome trace next to the JSON results when --trace is given.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import grpo_step
import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--gradient-checkpointing", type=int, default=1)
    parser.add_argument("--torch-compile", type=int, default=0)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--workload", choices=sorted(grpo_step.WORKLOADS), default="standard")
    parser.add_argument("--max-tokens", type=int, default=0, help="packed updates with this token budget")
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--set", action="append", default=[], help="grpoflow config KEY=VALUE")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    args.steps, args.workdir = 2, tempfile.mkdtemp(prefix="profile_step_")
    workload = grpo_step.WORKLOADS[args.workload]
    args.new_tokens = args.new_tokens or workload["new_tokens"]
    model_dir, prompts = grpo_step.write_inputs(
        Path(args.workdir), args.smoke, num_prompts=192, eos_mean_length=workload["eos_mean_length"]
    )
    from grpoflow.run.build import build_trainer
    from grpoflow.run.config import load_config

    config = load_config(None, grpo_step.grpoflow_overrides(args, model_dir, prompts))
    trainer = build_trainer(config)
    trainer.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        metrics = trainer.step()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print({key: round(value, 3) for key, value in metrics.items() if key.startswith("time/")})
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(profiler.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=60))
    print(
        profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    )
    if args.trace:
        profiler.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
