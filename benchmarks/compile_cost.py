"""What compiling the update's decoder layers costs a run: with Inductor's caches empty, then in a
second run that finds them, and whether a micro-batch of another size or length traces the layers
again.

    python benchmarks/compile_cost.py                            # the 0.5B shape, every parameter
    python benchmarks/compile_cost.py --lora 16 --preset qwen2.5-7b --rows 16

Each run is a fresh process; the two share one new cache directory (XDG_CACHE_HOME). A run builds
the random model (`grpoflow.policy.tiny`, adapters with `--lora`), compiles its layers as `grpoflow
train` does (`compiling.compile_layers`, after which the adapters go on) and times a forward and
backward of --rows x --length tokens, the same again, then --resized rows, then those rows 17
tokens longer (a length no multiple of 8). By default --rows equals the 0.5B shape's head width (64), the case where torch's duck
sizing tied the two sizes and the next micro-batch traced the layers again. The table gives each
call's seconds, the graphs Dynamo traced, AOTAutograd's cache hits and two of Dynamo's phases:
`bytecode_tracing` (tracing a layer, which no cache holds) and `OutputGraph.call_user_compiler`
(AOTAutograd and Inductor, from their caches in the second run). Results go to benchmarks/results/ as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from gpu_clock import synchronize
from report_file import save_result

PHASES = ("bytecode_tracing", "OutputGraph.call_user_compiler", "_compile.compile_inner")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="qwen2-0.5b")
    parser.add_argument(
        "--lora", type=int, default=0, help="LoRA rank on every linear layer (0: full training)"
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--resized", type=int, default=96, help="rows of the third micro-batch")
    parser.add_argument("--length", type=int, default=384)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=None, help="the JSON report's path (default: benchmarks/results/)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def timed_calls(args: argparse.Namespace) -> dict:
    """One run: the compiled model's micro-batches timed, Dynamo's traces, caches and phases."""
    from torch._dynamo.utils import compile_times, counters

    from grpoflow.policy.compiling import compile_layers, trace_every_layer_alike
    from grpoflow.policy.lora import AdapterConfig
    from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_preset_model(args.preset, len(build_char_tokenizer()), dtype=dtype, device=device)
    model.config.use_cache = False
    compile_layers(model, backend=args.backend)
    if args.lora:
        adapter = AdapterConfig(train_type="lora", lora_rank=args.lora, target_modules=["all-linear"])
        model = adapter.apply(model)
    trace_every_layer_alike(model)
    model.train()
    calls = []
    shapes = [(args.rows, args.length)] * 2 + [(args.resized, args.length), (args.resized, args.length + 17)]
    for rows, length in shapes:
        ids = torch.randint(0, model.config.vocab_size, (rows, length), device=device)
        synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids).logits[:, -1].float().sum().backward()
        synchronize(device)
        calls.append({"rows": rows, "length": length, "seconds": round(time.perf_counter() - start, 3)})
    names, values = compile_times(repr="csv", aggregate=True)
    phases = {
        name: round(float(value), 3) for name, value in zip(names, values, strict=True) if name in PHASES
    }
    return {
        "calls": calls,
        "graphs": counters["stats"]["unique_graphs"],
        "aot_autograd": dict(counters["aot_autograd"]),
        "phases": phases,
    }


def run_twice(argv: list[str]) -> list[dict]:
    """Two runs in fresh processes with one new cache directory: caches empty, then warm."""
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        for name in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE"):
            env.pop(name, None)
        for caches in ("empty", "warm"):
            command = [sys.executable, __file__, *argv, "--child"]
            result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise SystemExit(f"the {caches}-cache run failed:\n{result.stderr[-4000:]}")
            runs.append({"caches": caches, **json.loads(result.stdout.strip().splitlines()[-1])})
    return runs


def table(runs: list[dict]) -> str:
    """One line per run: each call's seconds, the graphs traced, cache hits and Dynamo's phases."""
    head = runs[0]["calls"]
    calls = "".join(f"{str(c['rows']) + 'x' + str(c['length']) + ' s':>12}" for c in head)
    lines = [f"{'caches':<7}{calls}{'graphs':>8}{'aot hits':>9}{'tracing s':>11}{'backend s':>11}"]
    for run in runs:
        seconds = "".join(f"{c['seconds']:>12.2f}" for c in run["calls"])
        hits = run["aot_autograd"].get("autograd_cache_hit", 0)
        phases = run["phases"]
        tracing, backend = (
            phases.get("bytecode_tracing", 0.0),
            phases.get("OutputGraph.call_user_compiler", 0.0),
        )
        lines.append(
            f"{run['caches']:<7}{seconds}{run['graphs']:>8}{hits:>9}{tracing:>11.2f}{backend:>11.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = arguments(argv)
    if args.child:
        print(json.dumps(timed_calls(args)))
        return {}
    runs = run_twice(argv)
    print(table(runs))
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    kind = f"compile-cost-{args.preset}{f'-lora{args.lora}' if args.lora else ''}"
    return save_result(kind, args.tag, device, args.out, args=vars(args), runs=runs)


if __name__ == "__main__":
    main()
