"""A whole GRPO step, grpoflow against TRL's GRPOTrainer, on the same GPU in one run.

    python benchmarks/grpo_step.py                  # both systems, the standard workload
    python benchmarks/grpo_step.py --systems grpoflow --steps 3
    python benchmarks/grpo_step.py --smoke          # a tiny model on the CPU, to check the script
    python benchmarks/grpo_step.py --systems grpoflow,trl,trl-fp32
    python benchmarks/grpo_step.py --workload long-tail   # long-tailed lengths
    python benchmarks/grpo_step.py --workload long-tail --max-tokens 8192   # grpoflow packed

`trl-fp32` gives TRL the same weights saved in float32, which it then trains as the Hugging Face
Trainer does mixed precision (float32 master weights, bf16 autocast) and samples from in float32.

The standard workload: a random-initialised Qwen2-0.5B-shaped model in bf16, 64 prompts x 8
generations, prompt 128 tokens, 256 new tokens, beta 0, one optimizer step per generation batch.
With no grpoflow option (--micro-batch, --gradient-checkpointing, --torch-compile, --max-tokens,
--set) grpoflow runs as `grpoflow train` does by default: the settings it leaves unset are chosen
from the memory plan for the GPU (`grpoflow.run.chosen_settings`), and the JSON says `"defaults":
true`; TRL takes micro-batch 32 with gradient checkpointing. Each grpoflow row also gives the step
time `grpoflow plan` predicts (`predicted_seconds_per_step`; at the mean completion length the
steps produced, `predicted_at_measured_length`); `chosen_settings` says whether Liger's kernels
ran and why (`use_liger_kernel`: auto leaves them off where compile is chosen; `--torch-compile 0`
runs them, `--set use_liger_kernel=false` compares without). `update_mfu` counts 6 FLOPs per
trained token and active parameter, 4 for a LoRA policy (`step_report.flops_per_token_parameter`).
Prompts are 128 random characters, which the character tokenizer maps to exactly 128 tokens. Each
system runs in its own subprocess (clean GPU memory); the first `--warmup` steps are left out of
the means. Results go to benchmarks/results/ as JSON.

The long-tail workload (`--workload long-tail`): the same model with its end-of-sequence logit
raised (`step_inputs.raise_eos_probability`: a bias on the last layer's values, calibrated so that about one
sampled token in 300 is EOS), so completion lengths are roughly geometric with a mean near 300,
up to 1024 new tokens; both sides update in padded micro-batches of `--micro-batch` completions,
or grpoflow padding-free with micro-batches of at most `--max-tokens` tokens when given. Both
sides load the same checkpoint and prompts; the table gives the lengths each actually produced.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import step_report as report
import torch
from step_inputs import write_inputs
from transformers import TrainerCallback

RESULTS = Path(__file__).parent / "results"
RUN_STEPS = 500
"""The run length grpoflow's settings are chosen for (`grpoflow.run.chosen_settings`)."""

WORKLOADS = {
    "standard": {"new_tokens": 256, "micro_batch": 32, "eos_mean_length": None},
    "long-tail": {"new_tokens": 1024, "micro_batch": 16, "eos_mean_length": 300.0},
}
"""Defaults of each workload; --new-tokens and --micro-batch override them."""


def reward_length(completions, **kwargs):
    """A cheap reward with spread: the completion's length in characters, scaled."""
    return [len(text) / 256 for text in completions]


def uses_defaults(args) -> bool:
    """No grpoflow setting was passed: grpoflow runs as `grpoflow train` does by default."""
    given = (args.micro_batch, args.gradient_checkpointing, args.torch_compile)
    return all(value is None for value in given) and not args.max_tokens and not args.set


def grpoflow_overrides(args, model_dir: Path, prompts: Path) -> dict:
    """grpoflow's config for the workload: 512 completions a step, the speed settings as passed
    (those not passed left to grpoflow's choice)."""
    from grpoflow.policy.auto_settings import DEFAULT_MICRO_BATCH

    micro_batch = args.micro_batch
    settings = {
        "per_device_train_batch_size": micro_batch,
        "gradient_checkpointing": None
        if args.gradient_checkpointing is None
        else bool(args.gradient_checkpointing),
        "torch_compile": None if args.torch_compile is None else bool(args.torch_compile),
    }
    return {
        "model": f"random:{args.preset}" if getattr(args, "in_memory", False) else str(model_dir),
        "dataset": str(prompts),
        "reward_funcs": [f"{Path(__file__).resolve()}:reward_length"],
        "num_generations": report.GROUP_SIZE,
        **{key: value for key, value in settings.items() if value is not None},
        "gradient_accumulation_steps": report.COMPLETIONS // (micro_batch or DEFAULT_MICRO_BATCH),
        "max_prompt_length": report.PROMPT_TOKENS,
        "max_completion_length": args.new_tokens,
        "beta": 0.0,
        "learning_rate": 1e-6,
        # the steady state of a long run: its settings chosen as for RUN_STEPS steps (a short run
        # would leave torch_compile off), of which the first args.steps are timed
        "max_steps": max(args.steps, RUN_STEPS),
        "rollout_engine": args.engine,
        "output_dir": str(Path(args.workdir) / "grpoflow"),
        "save_steps": 10_000,
        "report_to": ["none"],
        "disable_tqdm": True,
        "dataset_shuffle": False,
        **({"padding_free": True, "max_tokens_per_micro_batch": args.max_tokens} if args.max_tokens else {}),
        **extra_overrides(getattr(args, "set", None)),
    }


def extra_overrides(items: list[str] | None) -> dict:
    """`--set KEY=VALUE` pairs (VALUE read as YAML) for grpoflow's config."""
    import yaml

    overrides = {}
    for item in items or []:
        key, separator, value = item.partition("=")
        if not separator:
            raise SystemExit(f"--set {item!r}: write KEY=VALUE, e.g. --set logprob_chunk_size=4096")
        overrides[key] = yaml.safe_load(value)
    return overrides


def run_grpoflow(args, model_dir: Path, prompts: Path) -> dict:
    from grpoflow.run.build import build_trainer
    from grpoflow.run.chosen_settings import choose_for_run, gpu_spec, predicted_step
    from grpoflow.run.config import load_config

    config = load_config(None, grpoflow_overrides(args, model_dir, prompts))
    resolved, chosen = choose_for_run(config)  # the choice build_trainer makes
    gpu = gpu_spec(resolved)
    extra = {
        "chosen_settings": chosen.record(),
        "predicted_seconds_per_step": predicted_step(resolved, gpu).total if gpu is not None else None,
    }
    trainer = build_trainer(config)
    steps = []
    for _ in range(args.steps):
        start = time.perf_counter()
        metrics = trainer.step()
        metrics["time/wall"] = time.perf_counter() - start
        trainer.observe(metrics)  # as `grpoflow train` does: a compiled run records its compile cost
        steps.append(metrics)
        if gpu is not None:  # the prediction again, at the mean length the steps so far produced
            mean = sum(step["completions/mean_length"] for step in steps) / len(steps)
            extra["predicted_at_measured_length"] = predicted_step(resolved, gpu, mean).total
        save_result(args, steps, extra)
    return {"steps": steps, "peak_gib": report.peak_gib(), **extra}


def save_result(args, steps: list[dict], extra: dict | None = None) -> None:
    """The child's steps so far (and `extra` facts of its run), written whole (a rename), so that
    a run cut off by --time-limit still reports the steps it finished."""
    path = Path(args.workdir) / f"{args.child}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(
        json.dumps({"steps": steps, "peak_gib": report.peak_gib(), **(extra or {})}, default=float)
    )
    partial.replace(path)


class StepTimer(TrainerCallback):
    """Wall time per TRL optimizer step, split by timing TRL's own generate-and-score and reward
    methods (rollout = generate-and-score minus rewards; update = the rest), and the completion
    lengths TRL logs for the step."""

    def __init__(self, args) -> None:
        self.args = args
        self.steps: list[dict] = []
        self.seconds = {"generate_and_score": 0.0, "reward": 0.0}

    def wrap(self, trainer, method: str, key: str) -> None:
        original = getattr(trainer, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start

        setattr(trainer, method, timed)

    def on_step_begin(self, *_, **__):
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def on_step_end(self, *_, **__):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.start
        generate = self.seconds["generate_and_score"]
        self.steps.append(
            {
                "time/wall": wall,
                "time/rollout": generate - self.seconds["reward"],
                "time/reward": self.seconds["reward"],
                "time/update": wall - generate,
            }
        )

    def on_log(self, *_, logs=None, **__):
        # TRL logs after each optimizer step (logging_steps=1): its batch's completion lengths.
        if self.steps and logs:
            for key in ("completions/mean_length", "completions/max_length"):
                if key in logs:
                    self.steps[-1][key] = float(logs[key])
            save_result(self.args, self.steps)


def run_trl(args, model_dir: Path, prompts: Path) -> dict:
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    timer = StepTimer(args)
    micro_batch = args.micro_batch or WORKLOADS[args.workload]["micro_batch"]
    config = GRPOConfig(
        output_dir=str(Path(args.workdir) / "trl"),
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=report.COMPLETIONS // micro_batch,
        num_generations=report.GROUP_SIZE,
        max_completion_length=args.new_tokens,
        beta=0.0,
        learning_rate=1e-6,
        gradient_checkpointing=True,
        bf16=True,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=args.smoke,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward_length,
        args=config,
        train_dataset=load_dataset("json", data_files=str(prompts))["train"],
        processing_class=tokenizer,
        callbacks=[timer],
    )
    timer.wrap(trainer, "_generate_and_score_completions", "generate_and_score")
    timer.wrap(trainer, "_calculate_rewards", "reward")
    trainer.train()
    return {"steps": timer.steps, "peak_gib": report.peak_gib()}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", default="grpoflow,trl")
    parser.add_argument(
        "--preset", default="qwen2-0.5b", help="the random model's shape (grpoflow.policy.tiny.PRESETS)"
    )
    parser.add_argument("--steps", type=int, default=4, help="steps run, the --warmup steps included")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the means")
    parser.add_argument("--engine", default="auto", help="grpoflow's rollout_engine")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="standard")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="completions per micro-batch (grpoflow: unset, chosen from the memory plan; TRL: the workload's)",
    )
    parser.add_argument("--new-tokens", type=int, default=None, help="max_completion_length")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="grpoflow: packed updates with this token budget per micro-batch (0: padded)",
    )
    parser.add_argument(
        "--gradient-checkpointing", type=int, default=None, help="grpoflow's (unset: chosen from the plan)"
    )
    parser.add_argument(
        "--torch-compile", type=int, default=None, help="grpoflow's (unset: chosen from the plan)"
    )
    parser.add_argument("--set", action="append", default=[], help="grpoflow config KEY=VALUE")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="grpoflow builds random:PRESET on its device, no weights written (shapes too large to "
        "save, e.g. qwen3-30b-a3b); grpoflow only",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=0,
        help="seconds for the whole run: a system still running then is stopped and reported on "
        "the steps it finished (0: none)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.new_tokens = args.new_tokens or WORKLOADS[args.workload]["new_tokens"]
    if not 0 <= args.warmup < args.steps:
        parser.error(
            f"--steps {args.steps} counts the --warmup {args.warmup} steps too, and at least one step "
            f"must be timed after them: pass --steps {args.warmup + 1} or more"
        )
    if args.in_memory and not args.child and args.systems != "grpoflow":
        parser.error("--in-memory runs grpoflow only (TRL reads its model from disk): add --systems grpoflow")
    return args


def preset_shape(preset: str):
    """The transformers config of a random preset model (grpoflow.policy.tiny.PRESETS)."""
    from grpoflow.policy.tiny import build_char_tokenizer, preset_config

    return preset_config(preset, len(build_char_tokenizer()))


def child_command(args, system: str, workdir: Path) -> list[str]:
    """The command line that runs one system's steps in a process of its own."""
    command = [sys.executable, __file__, "--child", system, "--workdir", str(workdir)]
    command += [f"--steps={args.steps}", f"--engine={args.engine}"]
    command += [
        f"--workload={args.workload}",
        f"--max-tokens={args.max_tokens}",
        f"--new-tokens={args.new_tokens}",
    ]
    given = {
        "micro-batch": args.micro_batch,
        "gradient-checkpointing": args.gradient_checkpointing,
        "torch-compile": args.torch_compile,
    }
    command += [f"--{flag}={value}" for flag, value in given.items() if value is not None]
    command += [f"--preset={args.preset}"] + (["--in-memory"] if args.in_memory else [])
    command += ["--smoke"] if args.smoke else []
    return command + [f"--set={item}" for item in args.set]


def run_child(args, system: str, workdir: Path, deadline: float | None) -> dict | None:
    """Run one system's steps in its own process, stopped at `deadline` (monotonic seconds);
    the steps it finished (None: none)."""
    process = subprocess.Popen(child_command(args, system, workdir))
    try:
        code = process.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        print(f"{system}: stopped at --time-limit {args.time_limit:g} s", flush=True)
    else:
        if code != 0:
            raise SystemExit(f"{system} failed with exit code {code}")
    path = workdir / f"{system}.json"
    result = json.loads(path.read_text()) if path.exists() else None
    return result if result and result["steps"] else None


def main() -> None:
    args = parse_args()
    if args.child:
        runner = {"grpoflow": run_grpoflow, "trl": run_trl, "trl-fp32": run_trl}[args.child]
        workdir = Path(args.workdir)
        model_dir = workdir / ("model-fp32" if args.child == "trl-fp32" else "model")
        runner(args, model_dir, workdir / "prompts.jsonl")
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="grpo_step_"))
    systems = args.systems.split(",")
    write_inputs(
        workdir,
        args.smoke,
        num_prompts=64 * (args.steps + 1),
        float32_copy="trl-fp32" in systems,
        eos_mean_length=WORKLOADS[args.workload]["eos_mean_length"],
        preset=args.preset,
        in_memory=args.in_memory,
    )
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    tflops = report.matmul_tflops(gpu)
    transformers = __import__("transformers")
    with torch.device("meta"):  # shapes only: no weights read
        config = (
            preset_shape(args.preset)
            if args.in_memory
            else transformers.AutoConfig.from_pretrained(workdir / "model")
        )
        num_params = report.active_parameters(transformers.AutoModelForCausalLM.from_config(config))
    rows = []
    deadline = time.monotonic() + args.time_limit if args.time_limit else None
    for system in systems:
        result = run_child(args, system, workdir, deadline)
        if result is None:
            print(f"{system}: no step finished within --time-limit")
            continue
        passes = report.flops_per_token_parameter(args.set if system == "grpoflow" else [])
        row = report.summarize(system, result, args.warmup, num_params, tflops, passes)
        if len(result["steps"]) < args.steps:
            row["steps_done"] = len(result["steps"])  # cut off by --time-limit
        rows.append(row)
    ours = next((row for row in rows if row["system"] == "grpoflow"), None)
    for row in list(rows):
        if row["system"].startswith("trl") and ours and ours["seconds_per_step"] and row["seconds_per_step"]:
            ratio = row["seconds_per_step"] / ours["seconds_per_step"]
            rows.append({"system": f"ratio {row['system']}/grpoflow", "seconds_per_step": ratio})
    date = datetime.date.today().isoformat()
    record = {"gpu": gpu, "date": date, "defaults": uses_defaults(args), "num_params": num_params}
    record |= {"mfu_flops_per_token_parameter": report.flops_per_token_parameter(args.set)}
    record |= {"args": vars(args), "rows": rows}
    workload = "" if args.workload == "standard" else f"{args.workload}-"
    out = Path(args.out) if args.out else RESULTS / f"{date}-grpo-step-{workload}{gpu.replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=float))
    report.print_table(rows)


if __name__ == "__main__":
    main()
