"""`grpoflow train`, `grpoflow export`, `grpoflow serve` (and the commands that grow beside them)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

from grpoflow.options.loader import load_config, parse_overrides
from grpoflow.run.config import GRPOConfig

RECIPES = Path(__file__).parent / "recipes"
DEFAULT_RECIPE = RECIPES / "default.yaml"


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


def describe_options() -> str:
    """Every key with its default and docstring-free type, grouped by section."""
    lines = []
    defaults = {section.name: section.default_factory() for section in dataclasses.fields(GRPOConfig)}
    for section, value in defaults.items():
        lines.append(f"\n[{section}]")
        for item in dataclasses.fields(value):
            lines.append(f"  --{item.name} (default: {getattr(value, item.name)!r})")
    return "\n".join(lines)


def train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="grpoflow train",
        description="Run GRPO. With no arguments, the embedded default (tiny model, echo task, CPU). "
        "With NPROC_PER_NODE set (and NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT for several "
        "nodes), runs itself under torchrun: data-parallel over that many processes per node.",
        epilog="Options (YAML keys or --key value):" + describe_options(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="a YAML recipe, or the name of a packaged recipe")
    known, rest = parser.parse_known_args(argv)
    from grpoflow.run import torchrun
    from grpoflow.run.build import build_trainer, run

    try:
        overrides = parse_overrides(rest)
        config = load_config(resolve_recipe(known.config, overrides), overrides)
        if torchrun.wants_launch(os.environ):
            return torchrun.launch(argv, os.environ)
        if os.environ.get("RANK", "0") != "0":  # rank 0 speaks for the run
            logging.getLogger().setLevel(logging.WARNING)
        trainer = build_trainer(config)
    except ValueError as error:
        print(f"grpoflow train: {error}", file=sys.stderr)
        return 2
    try:
        history = run(config, trainer)
    finally:
        trainer.distributed.close()
    if history and trainer.distributed.is_main:
        first, last = history[0].get("reward"), history[-1].get("reward")
        print(
            f"done: {len(history)} steps, reward {first:.3f} -> {last:.3f}, output in {config.training.output_dir}"
        )
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


def serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="grpoflow serve",
        description="Serve a model for rollouts over vLLM's HTTP protocol (/v1/completions, "
        "/v1/chat/completions, weight updates) on grpoflow's engines, for trainers in vllm_mode "
        "server and for TRL's VLLMClient.",
    )
    parser.add_argument("--model", required=True, help="a local directory, hub id, tiny or random:PRESET")
    parser.add_argument("--engine", default="native", help="native (default), hf or vllm")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (not on /health)")
    parser.add_argument("--served-model-name", help="model name clients send; default: --model")
    parser.add_argument("--max-model-len", type=int, help="prompt plus completion, in tokens")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoded at once")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--enforce-eager", action="store_true", help="vllm engine: no compilation")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--seed", type=int, default=42, help="initialisation seed of a random model")
    parser.add_argument("--batch-window-ms", type=float, default=5.0, help="wait for requests to batch")
    parser.add_argument("--trust-remote-code", action="store_true")
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        from grpoflow.server import ServeConfig
        from grpoflow.server import serve as run_server
    except ImportError as error:
        print(
            f"grpoflow serve: {error}; install the server extra: pip install 'grpoflow[server]'",
            file=sys.stderr,
        )
        return 2
    try:
        config = ServeConfig(**vars(args))
        run_server(config)
    except ValueError as error:
        print(f"grpoflow serve: {error}", file=sys.stderr)
        return 2
    return 0


COMMANDS = {"train": train, "export": export, "serve": serve}
USAGE = (
    "usage: grpoflow {train} [options]   (grpoflow train --help)\n"
    "       grpoflow {export} --checkpoint DIR --output OUT [--base MODEL]\n"
    "       grpoflow {serve} --model MODEL [--engine native|hf|vllm] [--port 8000] ...   (grpoflow serve --help)"
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
