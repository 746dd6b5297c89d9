"""Mixture-of-experts rollout throughput: the native engine's family path against its generic path
on a random Qwen3-30B-A3B-shaped model, in one run.

    python benchmarks/moe_rollout.py --layers 8     # 8 of the 48 layers, bf16, on CUDA
    python benchmarks/moe_rollout.py --layers 48    # the whole depth (about 61 GB of weights)
    python benchmarks/moe_rollout.py --device cpu --tiny   # a tiny model on the CPU, to check the script

The shape is Qwen3-30B-A3B's: hidden 2048, 32 query heads and 4 KV heads of 128, 128 experts of
intermediate size 768 with 8 routed per token, vocabulary 151936; every layer sparse. The workload
is a GRPO step's: 64 prompts of 128 random tokens x 8 samples x 64 new tokens, temperature 1,
ignore_eos. Both paths run the same prompts (the family path's median over `--repeats` calls after
a warm-up; the generic path's one call after a warm-up).

The roofline (one ideal time for the workload, both paths measured against it) is the bytes every decode step must read over the device-to-device copy bandwidth
measured in the same run (`rollout.copy_bandwidth`): the dense weights (attention, norms, routers,
output head; the embedding reads only its rows), the experts a step's rows touch (of E experts with
k chosen per token, a batch of B tokens chosen uniformly touches E (1 - (1 - k/E)^B) of them per
layer: all 128 at 512 rows), and the KV cache the step attends to.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import torch
from report_file import write_report
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

# Runs from a checkout with torch, transformers and triton alone: grpoflow and rollout.py by path
# (loaded from its file, so that no other module named `rollout` stands in for it).
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
_spec = importlib.util.spec_from_file_location(
    "rollout_benchmark", Path(__file__).resolve().with_name("rollout.py")
)
_rollout = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _rollout
_spec.loader.exec_module(_rollout)
Workload, copy_bandwidth, run_native, synchronize = (
    _rollout.Workload,
    _rollout.copy_bandwidth,
    _rollout.run_native,
    _rollout.synchronize,
)

from grpoflow.engines.base import SamplingParams  # noqa: E402
from grpoflow.engines.native import NativeEngine, NativeEngineConfig  # noqa: E402
from grpoflow.policy.tiny import PRESETS  # noqa: E402

BUILT_HERE = (
    "model_type",
    "num_hidden_layers",
    "max_position_embeddings",
    "tie_word_embeddings",
    "norm_topk_prob",
)
"""Keys of a preset that `build_model` sets itself."""
FULL_SHAPE = {key: value for key, value in PRESETS["qwen3-30b-a3b-8l"].items() if key not in BUILT_HERE}
TINY_SHAPE = {key: value for key, value in PRESETS["tiny-moe"].items() if key not in BUILT_HERE} | {
    "vocab_size": 512
}


def build_model(shape: dict, layers: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random Qwen3-MoE model, built on `device` in `dtype` (no float32 copy on the way)."""
    config = Qwen3MoeConfig(
        **shape,
        num_hidden_layers=layers,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def build_workload(
    vocab_size: int, prompts: int, samples: int, prompt_tokens: int, new_tokens: int
) -> Workload:
    rng = np.random.default_rng(0)
    ids = [rng.integers(2, vocab_size, prompt_tokens).tolist() for _ in range(prompts)]
    params = SamplingParams(n=samples, max_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=0)
    return Workload(f"grpo {prompts}x{samples}", ids, [params] * prompts, [], samples, [], "")


def decode_bytes(model) -> dict[str, float]:
    """Bytes a decode step reads: the dense weights', one layer's experts', per token of KV."""
    config = model.config
    expert_bytes = dense_bytes = 0
    for name, parameter in model.named_parameters():
        size = parameter.numel() * parameter.element_size()
        if ".experts." in name:
            expert_bytes += size
        elif "embed_tokens" not in name:
            dense_bytes += size
    sparse_layers = sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    element = model.dtype.itemsize
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * element
    per_expert = expert_bytes / max(sparse_layers, 1) / config.num_experts
    return dict(dense=dense_bytes, per_expert=per_expert, sparse_layers=sparse_layers, kv_per_token=kv)


def roofline_seconds(sizes: dict[str, float], config, result: dict) -> float:
    """The ideal time of the call's decode steps at the measured bandwidth (see the module doc)."""
    steps = max(result["decode_steps"], 1.0)
    rows = result["tokens"] / steps
    experts, top_k = config.num_experts, config.num_experts_per_tok
    touched = experts * (1 - (1 - top_k / experts) ** rows)
    step_bytes = sizes["dense"] + sizes["sparse_layers"] * touched * sizes["per_expert"]
    total = steps * step_bytes + result["decode_context_tokens"] * sizes["kv_per_token"]
    return total / result["bandwidth"]


def run_generic(engine: NativeEngine, workload: Workload, device: torch.device) -> dict:
    """One timed call after a warm-up call on two prompts."""
    engine.generate(workload.prompts[:2], workload.params[:2])
    synchronize(device)
    start = time.perf_counter()
    outputs = engine.generate(workload.prompts, workload.params)
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for group in outputs for c in group)
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, **engine.stats.extra)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and workload (CPU smoke run)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (Qwen3-30B-A3B has 48)")
    parser.add_argument("--repeats", type=int, default=3, help="timed family-path calls (the median counts)")
    parser.add_argument("--skip-generic", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layers = 2 if args.tiny else args.layers
    model = build_model(TINY_SHAPE if args.tiny else FULL_SHAPE, layers, device, dtype)
    counts = (4, 2, 16, 8) if args.tiny else (64, 8, 128, 64)
    workload = build_workload(model.config.vocab_size, *counts)
    sizes, bandwidth = decode_bytes(model), copy_bandwidth(device)
    engine_config = dict(
        max_num_seqs=512, max_model_len=256, gpu_memory_utilization=args.gpu_memory_utilization
    )
    if device.type != "cuda":
        engine_config["num_kv_blocks"] = 64
    rows, ideal = [], float("nan")
    for path in ("family", "generic"):
        if path == "generic" and args.skip_generic:
            continue
        config = NativeEngineConfig(**engine_config, force_generic=path == "generic")
        engine = NativeEngine(model, config=config)
        assert engine.path == path, f"the model runs on the {engine.path} path"
        if path == "family":
            result = run_native(engine, workload, device, 1 if args.tiny else args.repeats)
        else:
            result = run_generic(engine, workload, device)
        engine.sleep()
        if path == "family":  # the workload's ideal time, which both paths are measured against
            ideal = roofline_seconds(sizes, model.config, {**result, "bandwidth": bandwidth})
        rows.append(
            dict(
                path=path,
                layers=layers,
                tokens_per_s=result["tokens_per_s"],
                roofline_fraction=ideal / result["seconds"],
                seconds=result["seconds"],
                tokens=result["tokens"],
                decode_steps=result["decode_steps"],
                ms_per_decode_step=1000 * result["seconds"] / max(result["decode_steps"], 1),
                peak_gib=result.get("peak_gib", float("nan")),
            )
        )
        print(f"{path}: {result['tokens_per_s']:,.0f} tokens/s", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = dict(
        date=datetime.date.today().isoformat(),
        device=name,
        torch=torch.__version__,
        model=f"random Qwen3-30B-A3B shape, {layers} layers, {str(dtype).removeprefix('torch.')}"
        if not args.tiny
        else "tiny Qwen3-MoE smoke model, fp32",
        workload=dict(prompts=counts[0], samples=counts[1], prompt_tokens=counts[2], new_tokens=counts[3]),
        decode_bytes=sizes,
        copy_bandwidth_bytes_per_s=bandwidth,
        rows=rows,
    )
    if len(rows) == 2:
        report["family_over_generic"] = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    write(report, args.output)
    print_table(report)
    return report


def write(report: dict, output: str | None) -> None:
    """To `output`, else benchmarks/results/<date>-moe-rollout-<device>.json (and $OUT when set)."""
    write_report(report, f"{report['date']}-moe-rollout-{report['device'].replace(' ', '_')}.json", output)


def print_table(report: dict) -> None:
    print(
        f"\n{report['device']}, {report['model']}, copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s"
    )
    print(f"{'path':<9}{'layers':>7}{'tokens/s':>12}{'ms/step':>9}{'roofline':>10}")
    for row in report["rows"]:
        print(
            f"{row['path']:<9}{row['layers']:>7}{row['tokens_per_s']:>12,.0f}"
            f"{row['ms_per_decode_step']:>9.2f}{row['roofline_fraction']:>10.1%}"
        )


if __name__ == "__main__":
    main()
