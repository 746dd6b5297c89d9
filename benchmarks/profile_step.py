"""Profile one GRPO step of grpoflow on the standard workload and print where the time goes.

    python benchmarks/profile_step.py [--micro-batch 32] [--gradient-checkpointing 1] [--workload long-tail]
    torchrun --nproc_per_node 2 benchmarks/profile_step.py --smoke --set model=random:qwen2.5-7b \
        --set fsdp=true --micro-batch 16 --set gradient_accumulation_steps=8   # rank 0 prints

With no speed setting passed (micro-batch, checkpointing, compile), the step runs as
`grpoflow train` would by default. Runs `--warmup` steps (1; compiled runs want 2), then one step
under torch.profiler; prints the top operators by GPU time and by CPU time, then (last) each
phase's wall-clock seconds beside the GPU time of the kernels it launched, by kind (matrix
products, attention, log-prob, optimizer, fused Triton, NCCL, copies and the rest). Writes a Chrome
trace when --trace is given; with --sync-sites runs one more step counting where the host waited
for the GPU (`sync_sites`); with --idle one more, charging the GPU's idle time between kernels to
what the host was doing (`idle_gpu`).
"""

from __future__ import annotations

import argparse
import bisect
import os
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import grpo_step
import torch
from idle_gpu import idle_by_host, print_idle
from step_inputs import write_inputs
from sync_sites import print_sites, sync_sites
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from grpoflow.phases import PROFILER_PREFIX

KERNEL_KINDS = (
    ("nccl", r"nccl"),
    ("logprob", r"logprob|logsumexp|_log_prob"),
    ("attention", r"flash|fmha|attention|attn|varlen"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_|splitk|_matmul_kernel"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("triton", r"^triton_|_kernel$"),
    ("copy", r"copy|cat|split|fill|memcpy|memset|Memcpy|Memset"),
)
"""Kernel name patterns, first match wins; the rest count as `other` (eager elementwise, norms,
reductions)."""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--micro-batch", type=int, default=None, help="unset: as grpoflow train chooses")
    parser.add_argument("--gradient-checkpointing", type=int, default=None)
    parser.add_argument("--torch-compile", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--workload", choices=sorted(grpo_step.WORKLOADS), default="standard")
    parser.add_argument("--max-tokens", type=int, default=0, help="packed updates with this token budget")
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--set", action="append", default=[], help="grpoflow config KEY=VALUE")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=1, help="steps before the profiled one")
    parser.add_argument(
        "--sync-sites", action="store_true", help="one more step counting the host's waits by call site"
    )
    parser.add_argument(
        "--idle",
        action="store_true",
        help="one more step, Python frames profiled: the GPU's idle time by host activity",
    )
    args = parser.parse_args()
    args.workdir = tempfile.mkdtemp(prefix="profile_step_")
    args.steps = args.warmup + 1 + int(args.sync_sites) + int(args.idle)
    workload = grpo_step.WORKLOADS[args.workload]
    args.new_tokens = args.new_tokens or workload["new_tokens"]
    model_dir, prompts = write_inputs(
        Path(args.workdir), args.smoke, num_prompts=192, eos_mean_length=workload["eos_mean_length"]
    )
    from grpoflow.run.build import build_trainer
    from grpoflow.run.config import load_config

    config = load_config(None, grpo_step.grpoflow_overrides(args, model_dir, prompts))
    trainer = build_trainer(config)
    for _ in range(args.warmup):
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
    print_phases(metrics, phase_kernels(profiler))
    if args.sync_sites:
        with sync_sites() as counts:
            trainer.step()
        print_sites(counts)
    if args.idle:
        with profile(activities=activities, with_stack=True) as profiler:
            trainer.step()
        print_idle(idle_by_host(profiler), args.rows, profiler)


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name)), "other")


def phase_kernels(profiler) -> dict[str, dict[str, float]]:
    """GPU seconds per phase and kernel kind: each kernel is charged to the innermost phase range
    open when it started (phases synchronise the GPU at their edges, so a phase's kernels run
    inside its wall-clock range)."""
    events = profiler.events()
    ranges = sorted(
        (event.time_range.start, event.time_range.end, event.name[len(PROFILER_PREFIX) :])
        for event in events
        if event.name.startswith(PROFILER_PREFIX) and event.device_type == DeviceType.CPU
    )
    starts = [start for start, _, _ in ranges]
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        if event.device_type != DeviceType.CUDA or event.is_user_annotation:
            continue  # a range drawn on the GPU's timeline (record_function) is not a kernel
        begin = event.time_range.start
        index = bisect.bisect_right(starts, begin) - 1
        while index >= 0 and ranges[index][1] < begin:
            index -= 1  # an earlier, longer range may still enclose it (nesting)
        name = ranges[index][2] if index >= 0 else "(no phase)"
        seconds[name][kernel_kind(event.name)] += event.time_range.elapsed_us() / 1e6
    return seconds


def print_phases(metrics: dict, kernels: dict[str, dict[str, float]]) -> None:
    kinds = [kind for kind, _ in KERNEL_KINDS] + ["other"]
    print("phase | wall s | GPU s | " + " | ".join(kinds))
    names = sorted(
        {key.removeprefix("time/") for key in metrics if key.startswith("time/")} | set(kernels),
        key=lambda name: -metrics.get(f"time/{name}", 0.0),
    )
    everything: dict[str, float] = defaultdict(float)
    for per_kind in kernels.values():
        for kind, seconds in per_kind.items():
            everything[kind] += seconds
    for name in names:
        gpu = everything if name == "step" else kernels.get(name, {})
        wall = metrics.get(f"time/{name}")
        cells = [f"{gpu.get(kind, 0.0):.3f}" for kind in kinds]
        wall_cell = f"{wall:.3f}" if wall is not None else "-"
        print(f"{name} | {wall_cell} | {sum(gpu.values()):.3f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
