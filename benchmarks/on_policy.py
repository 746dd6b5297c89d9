"""What on-policy sampling costs per GRPO step, and the engine/trainer log-prob gap with and without it.

    python benchmarks/on_policy.py              # random Qwen2-0.5B shape, bf16, on the GPU
    python benchmarks/on_policy.py --smoke      # a tiny model on the CPU, to check the script
    python benchmarks/on_policy.py --peaked-entropy 0.45   # distributions as sharp as a trained model's

The workload is grpo_step.py's standard one (64 prompts x 8, prompt 128, 256 new tokens, micro-batch
32, gradient checkpointing) through the native engine, once as it samples by default and once with
`on_policy_sampling`, replaying the stock forward (on_policy) or with both forwards on the
batch-invariant kernels (on_policy_batch_invariant, `batch_invariant: true`), whose draws the
update checks bit for bit (`on_policy_check: auto`, which is update there) or the trainer replays
first (on_policy_batch_invariant_replay, `on_policy_check: replay`); modes with _truncated sample
with top_p 0.9, top_k 50 (which the update's check does not take: they replay). Each mode runs
in its own subprocess; the first `--warmup` steps are left out. `--rounds N` runs the modes in
turn N times and pools each mode's steps, so that a slow spell of the machine falls on all of
them; the last column is each mode's median step over the first mode's. For each mode the table gives the
step time, the rollout time (which includes the trainer's replay), the replay's own seconds, its
rounds and replaced tokens, and the gap between the log-probs the batch carries for its sampled
tokens and those the update's forward computes (`sampling/sampling_logp_difference`, nats per
token), and the whole-distribution check's total variation. A random model's next-token
distributions are nearly flat, a trained model's peaked: `--peaked-entropy E` scales the model's
final norm until its mean next-token entropy over the prompts is E nats (found by bisection,
written to the JSON), where the engine/trainer gap is larger and exact sampling replays more.
Results go to benchmarks/results/ as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
KEYS = (
    "time/step",
    "time/rollout",
    "on_policy/seconds",
    "on_policy/rounds",
    "on_policy/replaced_tokens",
    "on_policy/continued_tokens",
    "on_policy/unchecked_tokens",
    "on_policy/unverified_fraction",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/distribution_tv/mean",
    "sampling/distribution_tv/max",
    "completions/mean_length",
)


def reward_length(completions, **kwargs):
    return [len(text) / 256 for text in completions]


def write_inputs(
    directory: Path, smoke: bool, num_prompts: int, peaked_entropy: float = 0.0
) -> tuple[Path, Path, dict]:
    from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model, build_tiny_model

    tokenizer = build_char_tokenizer()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        if smoke:
            model = build_tiny_model(len(tokenizer), dtype=torch.bfloat16)
        else:
            model = build_preset_model("qwen2-0.5b", len(tokenizer), dtype=torch.bfloat16)
    peaked = sharpen(model, tokenizer, peaked_entropy) if peaked_entropy > 0 else {}
    model.save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    rng = random.Random(0)
    with open(directory / "prompts.jsonl", "w") as handle:
        for _ in range(num_prompts):
            handle.write(json.dumps({"prompt": "".join(rng.choice("abcdefghij") for _ in range(128))}) + "\n")
    return directory / "model", directory / "prompts.jsonl", peaked


@torch.no_grad()
def mean_entropy(model, ids: torch.Tensor) -> float:
    """The model's mean next-token entropy (nats) over the positions of `ids`, in float32."""
    logits = model(ids).logits.float()
    logps = logits.log_softmax(-1)
    return float(-(logps.exp() * logps).sum(-1).mean())


@torch.no_grad()
def sharpen(model, tokenizer, target: float, rounds: int = 30) -> dict:
    """Scale the final norm's weight so that the mean next-token entropy over random prompts of
    the benchmark's letters is `target` nats (bisection on the scale's logarithm); the scale and
    the entropy before and after."""
    rng = random.Random(1)
    texts = ["".join(rng.choice("abcdefghij") for _ in range(128)) for _ in range(8)]
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer(text)["input_ids"] for text in texts], device=device)
    norm = model.model.norm.weight
    original = norm.detach().clone()
    before = mean_entropy(model, ids)
    low, high = 0.0, 8.0  # log of the scale: 1 to e^8
    for _ in range(rounds):
        middle = (low + high) / 2
        norm.copy_(original * float(torch.tensor(middle).exp()))
        low, high = (middle, high) if mean_entropy(model, ids) > target else (low, middle)
    scale = float(torch.tensor((low + high) / 2).exp())
    norm.copy_(original * scale)
    return {
        "target_entropy": target,
        "entropy_before": before,
        "entropy": mean_entropy(model, ids),
        "norm_scale": scale,
    }


def config_values(args, mode: str, model_dir: Path, prompts: Path) -> dict:
    values = {
        "model": str(model_dir),
        "dataset": str(prompts),
        "reward_funcs": [f"{Path(__file__).resolve()}:reward_length"],
        "num_generations": 8,
        "per_device_train_batch_size": args.micro_batch,
        "gradient_accumulation_steps": args.prompts * 8 // args.micro_batch,
        "max_prompt_length": 128,
        "max_completion_length": args.new_tokens,
        "gradient_checkpointing": True,
        "learning_rate": 1e-6,
        "max_steps": args.steps,
        "rollout_engine": "native",
        "gpu_memory_utilization": 0.35,
        "output_dir": str(Path(args.workdir) / mode),
        "save_steps": 10_000,
        "report_to": ["none"],
        "disable_tqdm": True,
        "dataset_shuffle": False,
        "on_policy_sampling": mode.startswith("on_policy"),
        "batch_invariant": "batch_invariant" in mode,
    }
    if "_replay" in mode:
        values["on_policy_check"] = "replay"
    if mode.endswith("truncated"):
        values.update(top_p=0.9, top_k=50)
    return values


def run_child(args) -> None:
    from grpoflow.run.build import build_trainer
    from grpoflow.run.config import load_config

    workdir = Path(args.workdir)
    config = load_config(None, config_values(args, args.child, workdir / "model", workdir / "prompts.jsonl"))
    trainer = build_trainer(config)
    steps = []
    for _ in range(args.steps):
        steps.append(trainer.step())
        shown = {key: round(steps[-1][key], 4) for key in KEYS if key in steps[-1]}
        print(args.child, shown, flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    Path(args.out).write_text(json.dumps({"steps": steps, "peak_gib": peak}))


def summarize(mode: str, results: list[dict], warmup: int) -> dict:
    """One mode's row over its runs (each run's first `warmup` steps left out)."""
    steps = [step for result in results for step in (result["steps"][warmup:] or result["steps"])]
    seconds = [s["time/step"] for s in steps]
    peaks = [result["peak_gib"] for result in results if result["peak_gib"] is not None]
    row = {
        "mode": mode,
        "peak_gib": max(peaks) if peaks else None,
        "step_seconds": seconds,
        "median_step_seconds": statistics.median(seconds),
    }
    for key in KEYS:
        values = [step[key] for step in steps if key in step]
        if values:
            row[key] = max(values) if key.endswith("/max") else sum(values) / len(values)
    return row


def print_table(rows: list[dict]) -> None:
    columns = [
        ("mode", "mode", "{}"),
        ("step s", "time/step", "{:.3f}"),
        ("median", "median_step_seconds", "{:.3f}"),
        ("rollout s", "time/rollout", "{:.3f}"),
        ("replay s", "on_policy/seconds", "{:.3f}"),
        ("rounds", "on_policy/rounds", "{:.1f}"),
        ("replaced", "on_policy/replaced_tokens", "{:.1f}"),
        ("unverified", "on_policy/unverified_fraction", "{:.3f}"),
        ("gap mean", "sampling/sampling_logp_difference/mean", "{:.2e}"),
        ("gap max", "sampling/sampling_logp_difference/max", "{:.2e}"),
        ("TV max", "sampling/distribution_tv/max", "{:.2e}"),
        ("mean len", "completions/mean_length", "{:.0f}"),
    ]
    print(" | ".join(title for title, _, _ in columns) + " | median vs first")
    for row in rows:
        ratio = row["median_step_seconds"] / rows[0]["median_step_seconds"]
        cells = [fmt.format(row[key]) if key in row else "-" for _, key, fmt in columns]
        print(" | ".join(cells) + f" | {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=8, help="steps a mode (single steps vary by ~10%% on one GPU)"
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the modes in turn this many times (A B A B ...), so that a slow spell of the "
        "machine falls on every mode; each run warms up again",
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--modes",
        default="default,on_policy,on_policy_batch_invariant",
        help="of default, on_policy, on_policy_batch_invariant, on_policy_batch_invariant_replay, *_truncated",
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--peaked-entropy",
        type=float,
        default=0.0,
        help="scale the final norm to this mean next-token entropy in nats (0: the random model as built)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.prompts, args.micro_batch, args.new_tokens = 2, 0, 4, 8, 16
    if args.child:
        run_child(args)
        return
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as workdir:
        _, _, peaked = write_inputs(Path(workdir), args.smoke, args.prompts * args.steps, args.peaked_entropy)
        if peaked:
            print(f"peaked: {peaked}")
        for round_ in range(args.rounds):
            for mode in modes:
                out = Path(workdir) / f"{mode}-{round_}.json"
                command = [sys.executable, __file__, "--child", mode, "--workdir", workdir, "--out", str(out)]
                command += ["--steps", str(args.steps), "--prompts", str(args.prompts)]
                command += ["--micro-batch", str(args.micro_batch), "--new-tokens", str(args.new_tokens)]
                subprocess.run(command, check=True)
                results[mode].append(json.loads(out.read_text()))
    rows = [summarize(mode, results[mode], args.warmup) for mode in modes]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    RESULTS.mkdir(exist_ok=True)
    kind = "smoke" if args.smoke else device.replace(" ", "_")
    name = f"{datetime.date.today()}-on-policy-{'peaked-' if peaked else ''}{kind}.json"
    record = {"device": device, "args": vars(args), "peaked": peaked or None, "rows": rows}
    (RESULTS / name).write_text(json.dumps(record, indent=2))
    print(f"device: {device}; results: benchmarks/results/{name}")
    print_table(rows)


if __name__ == "__main__":
    main()
