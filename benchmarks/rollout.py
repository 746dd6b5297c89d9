"""Rollout throughput: the native engine against transformers' `generate`, in one run.

    python benchmarks/rollout.py            # the Qwen2-0.5B-shaped model, bf16, on CUDA
    python benchmarks/rollout.py --smoke    # a tiny model on the CPU, to check the script
    python benchmarks/rollout.py --preset qwen2.5-7b --workloads grpo --scale 0.25,1 --skip-transformers

Workloads: (1) GRPO: 64 prompts x 8 samples, prompt 128, 256 new tokens, temperature 1, ignore_eos;
(2) 512 distinct prompts x 1, same lengths; (3) ragged: 1024 prompts of 64-256 tokens, max_tokens
drawn from 32-1024. transformers runs a smaller slice of each (stated in the table) to keep the
whole run within minutes. The roofline is (weights + KV bytes read by every decode step) over the
device-to-device copy bandwidth measured in the same run; the fraction is that ideal time over the
median measured time of the whole generate call (prefill included; five calls after a warm-up).
`bound_fraction` takes the larger of that time and the products' FLOPs (2 x the weights a token
multiplies by, per generated token) over the GPU's measured matrix-product peak: at 7B and 512
sequences a decode step is bound by compute, not bytes. `--scale` sizes the workloads (0.25: the
GRPO workload's 16 prompts x 8, what each of 4 GPUs generates of the 64 x 8 step).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from transformers import GenerationConfig

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.policy.tiny import build_preset_model

sys.path.insert(0, str(Path(__file__).parent))
from gpu_clock import synchronize  # noqa: E402
from step_report import active_parameters, matmul_tflops  # noqa: E402


@dataclass
class Workload:
    """Prompts and per-prompt sampling parameters, plus the transformers slice."""

    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    hf_prompts: list[list[int]]
    hf_n: int
    hf_budgets: list[int]
    hf_note: str


WORKLOADS = ("grpo", "distinct", "ragged")
"""The workloads' short names (`--workloads`), in build_workloads' order."""


def build_workloads(vocab_size: int, scale: float, rng: np.random.Generator) -> list[Workload]:
    def prompts(count, low, high):
        return [rng.integers(2, vocab_size, int(rng.integers(low, high + 1))).tolist() for _ in range(count)]

    def sampling(max_tokens, n=1):
        return SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)

    count = max(1, round(64 * scale))
    grpo = prompts(count, 128, 128)
    distinct = prompts(8 * count, 128, 128)
    ragged = prompts(16 * count, 64, 256)
    budgets = rng.integers(32, 1025, len(ragged)).tolist()
    hf_new = 64
    hf_ragged = rng.integers(32, 257, 2 * count).tolist()
    return [
        Workload(
            f"grpo {count}x8", grpo, [sampling(256, 8)] * len(grpo), grpo, 8, [256] * 8 * len(grpo),
            "the same workload in full",
        ),
        Workload(
            f"{8 * count} distinct", distinct, [sampling(256)] * len(distinct), distinct, 1, [hf_new] * len(distinct),
            f"{len(distinct)} seqs, {hf_new} new tokens",
        ),
        Workload(
            "ragged 32-1024", ragged, [sampling(b) for b in budgets], ragged[: 2 * count], 1, hf_ragged,
            f"{2 * count} seqs, max_tokens 32-256 (batch runs to its longest)",
        ),
    ]  # fmt: skip


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second by a large device-to-device copy."""
    if device.type != "cuda":
        return float("nan")
    source = torch.randn(256 << 20, device=device)  # 1 GiB
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        target.copy_(source)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 20
    return 2 * source.numel() * source.element_size() / seconds


def run_native(engine: NativeEngine, workload: Workload, device: torch.device, repeats: int) -> dict:
    """The median of `repeats` timed calls, after one warm-up call."""
    engine.generate(workload.prompts, workload.params)  # warm-up: graphs captured, kernels compiled
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        outputs = engine.generate(workload.prompts, workload.params)
        synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = sum(len(c.token_ids) for group in outputs for c in group)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return dict(
        tokens=tokens,
        seconds=seconds,
        call_seconds=times,
        tokens_per_s=tokens / seconds,
        peak_gib=peak,
        **engine.stats.extra,
    )


def run_transformers(model, workload: Workload, device: torch.device) -> dict:
    """Left-padded batch sampling with `generate`; counts only the tokens each sequence asked for."""
    rows = [prompt for prompt in workload.hf_prompts for _ in range(workload.hf_n)]
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(rows):
        ids[row, length - len(prompt) :] = torch.tensor(prompt)
        mask[row, length - len(prompt) :] = 1
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max(workload.hf_budgets),
        eos_token_id=[], pad_token_id=0,
    )  # fmt: skip
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        warm = GenerationConfig(**{**config.to_dict(), "max_new_tokens": 2})
        model.generate(input_ids=ids[:8], attention_mask=mask[:8], generation_config=warm)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        synchronize(device)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(workload.hf_budgets)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, peak_gib=peak)


def profile_decode(engine: NativeEngine, workload: Workload, device: torch.device) -> dict:
    """Top kernels by GPU time over one generate call of the workload, and how busy the GPU was."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.generate(workload.prompts, workload.params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    busy = sum(event.self_device_time_total for event in events) / 1e6
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    kernels = [(event.key[:70], event.self_device_time_total / 1000) for event in top]
    return dict(wall_s=wall, gpu_busy_s=busy, kernels_ms=kernels)


def profile_products(model, workload: Workload, device: torch.device, config: NativeEngineConfig) -> list:
    """GPU milliseconds of each product shape over one generate call of the workload by an engine
    of `config` with CUDA graphs off (a replayed graph hides its kernels' shapes; the kernels are
    the same)."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    engine = NativeEngine(model, config=replace(config, use_cuda_graphs=False))
    engine.generate(workload.prompts, workload.params)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        engine.generate(workload.prompts, workload.params)
        torch.cuda.synchronize()
    engine.sleep()
    rows = []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in ("aten::mm", "aten::addmm") and event.device_time_total > 0:
            rows.append(
                (event.key, str(event.input_shapes)[:90], event.count, event.device_time_total / 1000)
            )
    return sorted(rows, key=lambda row: row[3], reverse=True)[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few sequences")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per workload (the median counts)")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/...)")
    parser.add_argument(
        "--profile-products", action="store_true", help="also GPU time per product shape (graphs off)"
    )
    parser.add_argument(
        "--preset", default="qwen2-0.5b", help="the model's shape (grpoflow.policy.tiny.PRESETS)"
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated of {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--scale", default="1", help="comma-separated workload sizes (1: 64 prompts x 8)")
    args = parser.parse_args()
    chosen = args.workloads.split(",")
    if not set(chosen) <= set(WORKLOADS):
        raise SystemExit(f"--workloads takes {', '.join(WORKLOADS)}; got {args.workloads}")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    preset = "tiny" if args.smoke else args.preset
    model = build_preset_model(preset, 512, max_position_embeddings=2048, dtype=dtype, device=device).eval()
    config_ = model.config
    head_dim = getattr(config_, "head_dim", None) or config_.hidden_size // config_.num_attention_heads
    kv_bytes_per_token = (
        config_.num_hidden_layers * 2 * config_.num_key_value_heads * head_dim * model.dtype.itemsize
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    product_parameters = active_parameters(model)
    bandwidth = copy_bandwidth(device)
    peak = matmul_tflops(torch.cuda.get_device_name()) if device.type == "cuda" else None
    config = NativeEngineConfig(
        max_num_seqs=64 if args.smoke else 512,
        max_model_len=1300,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    engine = NativeEngine(model, config=config)
    workloads = [
        workload
        for scale in ([0.05] if args.smoke else [float(value) for value in args.scale.split(",")])
        for name, workload in zip(
            WORKLOADS, build_workloads(model.config.vocab_size, scale, np.random.default_rng(0)), strict=True
        )
        if name in chosen
    ]
    results = []
    for workload in workloads:
        native = run_native(engine, workload, device, 1 if args.smoke else args.repeats)
        ideal = (
            native["decode_steps"] * weight_bytes + native["decode_context_tokens"] * kv_bytes_per_token
        ) / bandwidth
        native["roofline_fraction"] = ideal / native["seconds"]
        compute = 2 * product_parameters * native["tokens"] / (peak * 1e12) if peak else float("nan")
        native["bound_fraction"] = max(ideal, compute) / native["seconds"]
        native["bound"] = "FLOPs" if compute > ideal else "bytes"
        native["ms_per_decode_step"] = 1000 * native["seconds"] / max(native["decode_steps"], 1)
        # Share of the step loop the host spent waiting for the GPU's results (low: host-bound).
        loop = native.get("steps_seconds")
        native["gpu_wait_fraction"] = native.get("gpu_wait_seconds", 0.0) / loop if loop else float("nan")
        results.append(dict(workload=workload.name, native=native, hf_note=workload.hf_note))
        print(f"native {workload.name}: {native['tokens_per_s']:,.0f} tokens/s", flush=True)
    profile = profile_decode(engine, workloads[0], device)
    engine.sleep()
    if args.profile_products and profile:
        profile["products_ms"] = profile_products(model, workloads[0], device, config)
    if not args.skip_transformers:
        for result, workload in zip(results, workloads):
            result["transformers"] = run_transformers(model, workload, device)
            print(
                f"transformers {workload.name}: {result['transformers']['tokens_per_s']:,.0f} tokens/s",
                flush=True,
            )
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report = dict(
        date=datetime.date.today().isoformat(),
        device=gpu,
        torch=torch.__version__,
        model=f"random {preset} shape, bf16" if not args.smoke else "tiny smoke model, fp32",
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        copy_bandwidth_bytes_per_s=bandwidth,
        engine_config=dict(max_num_seqs=config.max_num_seqs, block_size=config.block_size),
        results=results,
        profile=profile,
    )
    print_report(report)
    shape = "" if preset == "qwen2-0.5b" else f"{preset}-"
    name = f"rollout-{shape}{gpu.replace(' ', '_')}-{report['date']}.json"
    paths = [Path(args.output) if args.output else Path(__file__).parent / "results" / name]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / name)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))


def print_report(report: dict) -> None:
    """The profile, then the table (last, so that it ends the output)."""
    profile = report["profile"]
    if profile:
        print(
            f"\nprofiled '{report['results'][0]['workload']}' call: wall {profile['wall_s'] * 1000:.0f} ms, "
            f"GPU busy {profile['gpu_busy_s'] * 1000:.0f} ms; top kernels (GPU ms):"
        )
        for name, ms in profile["kernels_ms"]:
            print(f"  {ms:9.1f}  {name}")
        if profile.get("products_ms"):
            print("products by shape, graphs off (GPU ms, calls):")
            for op, shapes, count, ms in profile["products_ms"]:
                print(f"  {ms:9.1f}  {count:6d}  {op} {shapes}")
    print(
        f"\n{report['device']}, copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"weights {report['weight_bytes'] / 1e9:.2f} GB"
    )
    print(f"{'workload':<16}{'native tok/s':>14}{'ms/step':>9}{'roofline':>10}{'bound':>13}{'GPU wait':>10}"
          f"{'peak GiB':>10}{'hf tok/s':>11}{'ratio':>8}  transformers slice")  # fmt: skip
    for result in report["results"]:
        native, hf = result["native"], result.get("transformers")
        hf_rate = hf["tokens_per_s"] if hf else float("nan")
        print(
            f"{result['workload']:<16}{native['tokens_per_s']:>14,.0f}{native['ms_per_decode_step']:>9.2f}"
            f"{native['roofline_fraction']:>10.1%}{native['bound_fraction']:>7.1%} {native['bound']:<5}"
            f"{native['gpu_wait_fraction']:>10.1%}"
            f"{native['peak_gib']:>10.1f}{hf_rate:>11,.0f}"
            f"{native['tokens_per_s'] / hf_rate:>8.1f}  {result['hf_note']}"
        )


if __name__ == "__main__":
    main()
