"""`grpoflow train`, `grpoflow eval`, `grpoflow export`, `grpoflow report`, `grpoflow serve` (and the
commands that grow beside them)."""

from __future__ import annotations

import argparse
import difflib
import gc
import logging
import os
import re
import sys
import textwrap
import typing
from importlib import metadata
from pathlib import Path

from grpoflow import options
from grpoflow.run.config import LEGACY_SECTIONS, GRPOConfig, load_config

RECIPES = Path(__file__).parent / "recipes"
DEFAULT_RECIPE = RECIPES / "default.yaml"
TRAIN_HELP = (
    "Run GRPO. With no arguments, the embedded default (tiny model, echo task, CPU). With NPROC_PER_NODE "
    "set (and NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT for several nodes), runs itself under "
    "torchrun: data-parallel over that many processes per node."
)
EVAL_HELP = (
    "Evaluate a model or a run's checkpoint (--model DIR) on eval_dataset (or dataset) in eval_split: "
    "num_generations_eval samples per prompt with the run's engine, rewards and agent options; prints "
    "pass@k, maj@k, avg@n, each reward's mean, lengths and tokens/s, and writes eval_results.json and "
    "eval_completions.jsonl into --output_dir (default outputs/eval). Takes train's options."
)
REPORT_HELP = (
    "Write a run's report: one self-contained HTML file with plots of its metrics (reward, each "
    "reward function, evaluation, KL, entropy, lengths, clip and importance ratios, gradient norm, "
    "learning rate, time per phase, tokens/s, memory) and its highest- and lowest-advantage sample "
    "completions at a few steps. Works on a finished or a running run; needs matplotlib "
    "(pip install 'grpoflow[report]')."
)
SERVE_HELP = (
    "Serve a model for rollouts over vLLM's HTTP protocol (/v1/completions, /v1/chat/completions, "
    "weight updates) on grpoflow's engines, for trainers in vllm_mode server and for TRL's VLLMClient."
)


def resolve_recipe(name: str | None, overrides: dict) -> Path | None:
    """The recipe file to start from: `--config` as a path or a packaged recipe's name; with no
    --config and no --model, the embedded default."""
    if name is None:
        return None if "model" in overrides else DEFAULT_RECIPE
    path = Path(name)
    if path.is_file():
        return path
    packaged = RECIPES / f"{name.removesuffix('.yaml')}.yaml"
    if packaged.is_file():
        return packaged
    known = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
    raise ValueError(f"--config {name}: no such file, and no packaged recipe of that name ({known})")


def embedded_note() -> str:
    """What `grpoflow train` runs with no --config and no --model: the embedded recipe's settings."""
    settings = ", ".join(f"{key}={value}" for key, value in options.load_yaml(DEFAULT_RECIPE).items())
    return textwrap.fill(
        f"With no --config and no --model, the embedded recipe applies ({DEFAULT_RECIPE}): {settings}; "
        "flags override it. With --model or --config, the defaults below apply.",
        width=100,
    )


def describe_options() -> str:
    """Every key with its default and its one-line documentation, grouped by section."""
    lines, section = [], None
    for key, item in options.flat_fields(GRPOConfig).items():
        if item.path[0] != section:
            section = item.path[0]
            lines.append(f"\n[{section}]")
        doc = options.field_docs(item.owner).get(item.path[-1], "")
        choices = allowed_values(item.value_hint)
        lines.append(f"  --{key} (default: {item.default!r}{choices})  {doc}")
    return "\n".join(lines)


def recipe_note(message: str, recipe: Path | None, overrides: dict) -> str:
    """Where the settings an error names come from, when a recipe set them (not the flags)."""
    if recipe is None:
        return ""
    try:
        values = options.flatten(GRPOConfig, options.load_yaml(recipe), LEGACY_SECTIONS)
    except ValueError:  # the recipe itself is what is wrong
        return ""
    named = [key for key in values if key not in overrides and re.search(rf"\b{re.escape(key)}\b", message)]
    if not named:
        return ""
    where = "the embedded default recipe (no --config, no --model)" if recipe == DEFAULT_RECIPE else recipe
    settings = ", ".join(f"{key}={values[key]}" for key in named)
    keys = options.flat_fields(GRPOConfig)
    if named[0] in keys:
        return f" [{settings} set by {where}; a flag such as --{named[0]} overrides it]"
    close = difflib.get_close_matches(named[0], keys, n=1)
    spelled = f"the option is spelled {close[0]} (--{close[0]})" if close else "it is no option"
    return f" [{settings} set by {where}; {spelled}]"


def interrupted(step: int, output_dir: str) -> str:
    """What an interrupted run tells its user: where it stopped and how to go on."""
    from grpoflow.run.checkpoint import list_checkpoints

    saved = list_checkpoints(output_dir)
    if not saved:
        again = "run the same command" if step == 0 else "run again with --overwrite_output_dir true"
        return (
            f"stopped at step {step}, before its first checkpoint: nothing to resume in {output_dir}; "
            f"{again} to start over there"
        )
    return f"stopped at step {step}; resume from {saved[-1]} with --resume_from_checkpoint latest"


def allowed_values(hint: object) -> str:
    """`; one of a, b` for an option of a Literal type, else nothing."""
    hints = [hint, *typing.get_args(hint)]
    literal = next((h for h in hints if typing.get_origin(h) is typing.Literal), None)
    return f"; one of {', '.join(map(str, typing.get_args(literal)))}" if literal is not None else ""


def recipe_parser(prog: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A command's parser taking `--config` (a recipe) and leaving every other flag as an option."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="a YAML recipe, or the name of a packaged recipe")
    return parser


def train(argv: list[str]) -> int:
    epilog = embedded_note() + "\n\nOptions (YAML keys or --key value):" + describe_options()
    known, rest = recipe_parser("grpoflow train", TRAIN_HELP, epilog).parse_known_args(argv)
    from grpoflow.api.trainer import GRPOTrainer
    from grpoflow.run import torchrun
    from grpoflow.run.failures import RunStopped

    recipe, overrides = None, {}
    try:
        overrides = options.parse_overrides(rest)
        recipe = resolve_recipe(known.config, overrides)
        config = load_config(recipe, overrides)
        if torchrun.wants_launch(os.environ):
            return torchrun.launch(argv, os.environ)
        if os.environ.get("RANK", "0") != "0":  # rank 0 speaks for the run
            logging.getLogger().setLevel(logging.WARNING)
        trainer = GRPOTrainer.from_run_config(config)
        loop = trainer.build()
    except ValueError as error:
        print(f"grpoflow train: {error}{recipe_note(str(error), recipe, overrides)}", file=sys.stderr)
        return 2
    try:
        trainer.train()
    except KeyboardInterrupt:
        print(f"grpoflow train: {interrupted(loop.step_count, config.training.output_dir)}", file=sys.stderr)
        return 130
    except RunStopped as stopped:
        print(f"grpoflow train: {stopped}", file=sys.stderr)
        return 1
    finally:
        loop.distributed.close()
    history, is_main = trainer.run_history, loop.distributed.is_main
    # The policy's sharded modules, their device mesh and its process groups go now, while the
    # interpreter is whole: gloo's threads, ended during its teardown, can abort the process.
    del trainer, loop
    gc.collect()
    if history and is_main:
        first, last = history[0].get("reward"), history[-1].get("reward")
        errors = int(sum(step.get("rewards/num_errors", 0) for step in history))
        failed = int(sum(step.get("episodes/num_errors", 0) for step in history))
        failures = f", {errors} reward errors" if errors else ""
        failures += f", {failed} failed episodes" if failed else ""
        failures += " (logged as warnings)" if failures else ""
        print(
            f"done: {len(history)} steps, reward {first:.3f} -> {last:.3f}{failures}, "
            f"output in {config.training.output_dir}"
        )
    return 0


def plan(argv: list[str]) -> int:
    """Print the run's memory plan, the settings chosen from it and the step time they predict
    (config only: no weights load)."""
    epilog = (
        "The run's options as for grpoflow train; gpu_memory_gib plans for a GPU of that size, "
        "gpu_name (or gpu_memory_bandwidth_tbps and gpu_bf16_tflops) predicts its step time."
    )
    known, rest = recipe_parser(
        "grpoflow plan", "Predict each GPU's peak memory, by part, and the step time.", epilog
    ).parse_known_args(argv)
    from grpoflow.run.chosen_settings import choose_for_run, gpu_spec, planned_gpu, predicted_step
    from grpoflow.run.plan_check import few_rows_warning, format_plan, gpu_capacity, run_plan

    try:
        overrides = options.parse_overrides(rest)
        config = load_config(resolve_recipe(known.config, overrides), overrides)
        capacity = gpu_capacity(config)
        if capacity is None:
            raise ValueError("no GPU is visible: pass --gpu_memory_gib (e.g. 80) to plan for one")
        config, chosen = choose_for_run(config, planned_gpu(capacity))
        memory, blocks = run_plan(config, capacity)
        gpu = gpu_spec(config)
        step = predicted_step(config, gpu) if gpu is not None else None
    except ValueError as error:
        print(f"grpoflow plan: {error}", file=sys.stderr)
        return 2
    print(format_plan(memory))
    if blocks is not None:
        print(f"native engine KV cache: {blocks} blocks")
        few = few_rows_warning(config, blocks)
        if few is not None:
            print(f"warning: {few}")
    print(chosen.summary())
    if step is not None:
        print(f"{step.describe()} (GPU: {gpu.name})")
    else:
        print(
            "step time: pass --gpu_name (H100, H200, A100) or the GPU's measured --gpu_memory_bandwidth_tbps and --gpu_bf16_tflops"
        )
    return 0 if memory.fits else 1


def evaluate(argv: list[str]) -> int:
    epilog = "Options (YAML keys or --key value): see grpoflow train --help"
    known, rest = recipe_parser("grpoflow eval", EVAL_HELP, epilog).parse_known_args(argv)
    from grpoflow.run.evaluate_model import RESULTS_FILE, evaluate_model, results_table

    recipe, overrides = None, {}
    try:
        overrides = options.parse_overrides(rest)
        recipe = resolve_recipe(known.config, overrides)
        if "eval_dataset" in overrides and "dataset" not in overrides:
            overrides["dataset"] = overrides["eval_dataset"]
        overrides.setdefault("output_dir", "outputs/eval")
        config = load_config(recipe, overrides)
        metrics = evaluate_model(config)
    except ValueError as error:
        print(f"grpoflow eval: {error}{recipe_note(str(error), recipe, overrides)}", file=sys.stderr)
        return 2
    print(results_table(metrics))
    print(f"results in {Path(config.training.output_dir) / RESULTS_FILE}")
    return 0


def export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="grpoflow export",
        description="Write a checkpoint as a standalone model (save_pretrained, with the tokenizer): "
        "a LoRA checkpoint merged into its base model, a full checkpoint copied as it is.",
    )
    parser.add_argument(
        "--checkpoint", required=True, metavar="DIR", help="a checkpoint-N directory of a run"
    )
    parser.add_argument(
        "--output", required=True, metavar="OUT", help="where the model goes (a new or empty directory)"
    )
    parser.add_argument(
        "--base",
        metavar="MODEL",
        help="the base model of a LoRA checkpoint (directory, hub id, tiny, random:PRESET); "
        "default: the model of the run that wrote it",
    )
    args = parser.parse_args(argv)
    from grpoflow.run.export import export_checkpoint

    try:
        output = export_checkpoint(args.checkpoint, args.output, base=args.base)
    except ValueError as error:
        print(f"grpoflow export: {error}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {output}")
    return 0


def report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpoflow report", description=REPORT_HELP)
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="the output_dir of a run")
    parser.add_argument(
        "--output", metavar="FILE", help="where the HTML goes (default: OUTPUT_DIR/report.html)"
    )
    args = parser.parse_args(argv)
    from grpoflow.report import write_report

    try:
        written = write_report(args.output_dir, args.output)
    except (ValueError, ImportError) as error:
        print(f"grpoflow report: {error}", file=sys.stderr)
        return 2
    print(written.summary())
    return 0


def serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpoflow serve", description=SERVE_HELP)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        from grpoflow.server import ServeConfig
        from grpoflow.server import serve as run_server
    except ImportError as error:
        print(
            f"grpoflow serve: {error}; install the server extra: pip install 'grpoflow[server]'",
            file=sys.stderr,
        )
        return 2
    options.add_flags(parser, ServeConfig)
    args = parser.parse_args(argv)
    try:
        config = options.from_flags(ServeConfig, args)
        run_server(config)
    except ValueError as error:
        print(f"grpoflow serve: {error}", file=sys.stderr)
        return 2
    return 0


COMMANDS = {
    "train": train,
    "plan": plan,
    "eval": evaluate,
    "export": export,
    "report": report,
    "serve": serve,
}
USAGE = (
    "usage: grpoflow {train} [options]   (grpoflow train --help)\n"
    "       grpoflow {plan} [--config FILE] [--gpu_memory_gib GIB] [options]\n"
    "       grpoflow {eval} --model MODEL_OR_CHECKPOINT --eval_dataset DATA --reward_funcs ... [options]\n"
    "       grpoflow {export} --checkpoint DIR --output OUT [--base MODEL]\n"
    "       grpoflow {report} OUTPUT_DIR [--output FILE]\n"
    "       grpoflow {serve} --model MODEL [--engine native|hf|vllm] [--port 8000] ...   (grpoflow serve --help)"
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv and argv[0] in {"-h", "--help"}:
        print(USAGE)
        return 0
    if argv and argv[0] == "--version":
        print(f"grpoflow {metadata.version('grpoflow')}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        if argv:
            close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            print(f"grpoflow: unknown command {argv[0]!r}{hint}", file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
