"""Weight sync from a trainer to `grpoflow serve`: the collective transport against the checkpoint.

    python benchmarks/weight_sync.py                 # 2 GPUs: server on GPU 1, trainer on GPU 0
    python benchmarks/weight_sync.py --device cpu    # a tiny model and gloo, to check the script
    python benchmarks/weight_sync.py --deployments   # then step times: colocate, server, async

On CUDA the server runs the random Qwen2-0.5B-shaped model in bf16 (`--model random:qwen2-0.5b`)
with the native engine, in its own process that sees only `--server-gpu`; the trainer holds a
model of the same shape on `cuda:0`. Each transport runs `--warmup` full syncs (the first
collective one builds the NCCL group, timed apart as `first_ms`), then `--repeats` timed ones:
from the call of `RemoteEngine.update_weights` until every server has answered, weights in place.
Before each transport the trainer's weights change, and after its syncs the server's log-probs on
a probe prompt must match the trainer's (grpoflow.run.sync_check): the gap is reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_clock import synchronize

from grpoflow.policy.placement import Placement
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model
from grpoflow.remote.engine import RemoteEngine
from grpoflow.run.infer_workers import RolloutServers
from grpoflow.run.sync_check import SyncCheck

TRANSPORTS = ("collective", "checkpoint")
CHECK_TOLERANCE = 0.1
"""Largest mean log-prob gap (nats per token) accepted after a sync; bf16 noise is far below,
stale weights far above."""


def start_server(args: argparse.Namespace, log_dir: Path) -> RolloutServers:
    """`grpoflow serve` in a process of its own; on CUDA it sees only the server GPU."""
    flags = [
        "--model", f"random:{args.model}", "--dtype", args.dtype, "--max-model-len", "512",
        "--max-num-seqs", "16", "--gpu-memory-utilization", "0.5",
    ]  # fmt: skip
    return RolloutServers(flags, [args.server_gpu if args.device == "cuda" else None], log_dir)


def time_transport(
    engine: RemoteEngine, model: torch.nn.Module, args: argparse.Namespace, version: int
) -> tuple[dict, int]:
    """Warm-up and timed full syncs on one transport; returns the result and the next version."""
    device = next(model.parameters()).device
    times = []
    for _ in range(args.warmup + args.repeats):
        synchronize(device)
        start = time.perf_counter()
        engine.update_weights(model.named_parameters(), version)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
        version += 1
    timed = times[args.warmup :]
    probe = list(range(2, 34))
    check = SyncCheck(probe, tolerance=float("inf"))  # judged in main, after the results are written
    gap = check(engine, Placement.local(model), step=version)["sync/check_logprob_gap"]
    result = {
        "transport": engine.weight_transfer,
        "first_ms": times[0],
        "median_ms": statistics.median(timed),
        "min_ms": min(timed),
        "times_ms": timed,
        "check_logprob_gap": gap,
    }
    return result, version


def change_weights(model: torch.nn.Module) -> None:
    """Negate every parameter: a different model of the same shape, at no memory cost."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.neg_()


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    dtype = getattr(torch, args.dtype)
    model = build_preset_model(args.model, len(build_char_tokenizer()), seed=1, dtype=dtype, device=device)
    model.eval().requires_grad_(False)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="grpoflow-bench-") as directory:
        server = start_server(args, Path(directory) / "server")
        results, version = [], 1
        try:
            for transport in args.transports:
                change_weights(model)
                engine = RemoteEngine(
                    server.urls,
                    startup_timeout=600,
                    weight_sync_timeout=120,
                    weight_transfer=transport,
                    bucket_bytes=args.bucket_mb * 2**20,
                    sync_dir=Path(directory) / "checkpoints",
                )
                try:
                    result, version = time_transport(engine, model, args, version)
                finally:
                    engine.close()
                if transport == "collective":
                    result["backend"] = "nccl" if device.type == "cuda" else "gloo"
                results.append(result)
        except Exception:
            print(server.log_tail(0, 4000), file=sys.stderr)
            raise
        finally:
            server.close()
    return {
        "benchmark": "weight_sync",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "num_gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
        "torch": torch.__version__,
        "model": f"random:{args.model}",
        "dtype": args.dtype,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_bytes": num_bytes,
        "bucket_mb": args.bucket_mb,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "results": results,
    }


def print_table(report: dict) -> None:
    gib = report["num_bytes"] / 2**30
    print(f"\n{report['model']} {report['dtype']}: {gib:.2f} GiB, on {report['device']}, {report['date']}")
    print(
        f"{'transport':<12} {'median ms':>10} {'min ms':>10} {'first ms':>10} {'GB/s':>8} {'logprob gap':>12}"
    )
    for result in report["results"]:
        name = result["transport"] + (f" ({result['backend']})" if "backend" in result else "")
        rate = report["num_bytes"] / 1e9 / (result["median_ms"] / 1000)
        print(
            f"{name:<12} {result['median_ms']:>10.1f} {result['min_ms']:>10.1f} {result['first_ms']:>10.1f} "
            f"{rate:>8.1f} {result['check_logprob_gap']:>12.4f}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default=None, help="preset (default: qwen2-0.5b on cuda, tiny on cpu)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--server-gpu", type=int, default=1, help="the GPU the server process sees")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/...)")
    parser.add_argument(
        "--deployments",
        action="store_true",
        help="then the step time of colocate, server and async mode (benchmarks/deployments.py)",
    )
    args = parser.parse_args(argv)
    args.model = args.model or ("qwen2-0.5b" if args.device == "cuda" else "tiny")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and torch.cuda.device_count() < 2 and args.server_gpu != 0:
        raise SystemExit(
            "--device cuda needs 2 GPUs (or --server-gpu 0 to share one); --device cpu runs anywhere"
        )
    report = run(args)
    print_table(report)
    name = f"weight-sync-{report['device'].replace(' ', '_')}-{report['date']}.json"
    path = Path(args.output) if args.output else Path(__file__).parent / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    failed = [r["transport"] for r in report["results"] if r["check_logprob_gap"] > CHECK_TOLERANCE]
    if failed:
        raise SystemExit(f"the server's log-probs disagree with the trainer's after {', '.join(failed)}")
    if args.deployments:
        command = [sys.executable, str(Path(__file__).with_name("deployments.py"))]
        command += [f"--server-gpu={args.server_gpu}"] + (["--smoke"] if args.device == "cpu" else [])
        subprocess.run(command, check=True)
    return report


if __name__ == "__main__":
    main()
