"""Step time of the three deployments on the standard GRPO workload, in one run.

    python benchmarks/deployments.py                  # 2 GPUs: trainer on GPU 0, server on GPU 1
    python benchmarks/deployments.py --smoke          # a tiny model on the CPU, to check the script

- colocate: the native engine inside the trainer's process, generating from the policy's own
  weights on GPU 0 (no sync);
- server: `grpoflow serve --engine native` on GPU 1 and the trainer on GPU 0 in vllm_mode server,
  weights over the collective transport (NCCL) after every update;
- async: the same with async_generate: the next batch generates on GPU 1 while GPU 0 updates.

The workload is benchmarks/grpo_step.py's (64 prompts x 8, prompt 128, 256 new tokens, beta 0),
each mode in its own processes; `--set KEY=VALUE` adds grpoflow config. Prints seconds per step
and its split, and writes JSON to benchmarks/results/.
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

import grpo_step
import torch
from step_inputs import write_inputs

from grpoflow.run.infer_workers import RolloutServers

MODES = {
    "colocate": [],
    "server": ["use_vllm=true", "vllm_mode=server"],
    "async": ["use_vllm=true", "vllm_mode=server", "async_generate=true"],
}


def start_server(args, model_dir: Path, log_dir: Path) -> RolloutServers:
    """`grpoflow serve` on the server GPU (the CPU under --smoke) for the standard workload."""
    flags = [
        "--model", str(model_dir), "--dtype", "float32" if args.smoke else "bfloat16",
        "--max-model-len", str(128 + args.new_tokens + 8), "--max-num-seqs", "512",
        "--gpu-memory-utilization", "0.5", "--batch-window-ms", "1",
    ]  # fmt: skip
    return RolloutServers(flags, [None if args.smoke else args.server_gpu], log_dir)


def run_mode(args, mode: str, workdir: Path) -> dict:
    settings = list(MODES[mode]) + list(args.set)
    server = None
    if mode != "colocate":
        server = start_server(args, workdir / "model", workdir / f"servers-{mode}")
        settings.append(f"vllm_server_base_url={server.urls[0]}")
    env = dict(os.environ)
    if not args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = str(args.trainer_gpu)
    command = [sys.executable, str(Path(grpo_step.__file__).resolve()), "--child", "grpoflow"]
    command += ["--workdir", str(workdir), f"--steps={args.steps}", f"--micro-batch={args.micro_batch}"]
    command += [f"--new-tokens={args.new_tokens}", "--gradient-checkpointing=1"]
    command += [f"--torch-compile={args.torch_compile}"] + (["--smoke"] if args.smoke else [])
    command += [f"--set={item}" for item in settings]
    try:
        subprocess.run(command, check=True, env=env)
    finally:
        if server is not None:
            server.close()
    return json.loads((workdir / "grpoflow.json").read_text())


def summarize(mode: str, result: dict, warmup: int) -> dict:
    steady = result["steps"][warmup:] or result["steps"]

    def mean(key: str) -> float | None:
        values = [step[key] for step in steady if step.get(key) is not None]
        return sum(values) / len(values) if values else None

    row = {"mode": mode, "seconds_per_step": mean("time/wall")}
    for phase in ("rollout", "rollout_wait", "update", "sync", "sync_check"):
        row[f"{phase}_s"] = mean(f"time/{phase}")
    row["staleness"] = mean("async/staleness")
    row["is_ratio_mean"] = mean("sampling/importance_sampling_ratio/mean")
    row["trainer_peak_gib"] = result["peak_gib"]
    return row


def print_table(rows: list[dict]) -> None:
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        cells = [
            f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c] if row[c] is not None else "-")
            for c in columns
        ]
        print(" | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--torch-compile", type=int, default=1)
    parser.add_argument("--trainer-gpu", type=int, default=0)
    parser.add_argument("--server-gpu", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="grpoflow config KEY=VALUE")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.new_tokens, args.torch_compile = min(args.new_tokens, 16), 0
    workdir = Path(tempfile.mkdtemp(prefix="deployments_"))
    write_inputs(workdir, args.smoke, num_prompts=64 * (args.steps + 2))
    rows = []
    for mode in args.modes.split(","):
        start = time.perf_counter()
        rows.append(summarize(mode, run_mode(args, mode, workdir), args.warmup))
        print(f"{mode}: {time.perf_counter() - start:.0f} s", flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    date = datetime.date.today().isoformat()
    record = {"gpu": gpu, "date": date, "args": vars(args), "rows": rows}
    out = (
        Path(args.out) if args.out else grpo_step.RESULTS / f"{date}-deployments-{gpu.replace(' ', '_')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=float))
    print_table(rows)


if __name__ == "__main__":
    main()
