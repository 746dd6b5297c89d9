"""`grpoflow train`, `grpoflow export` (and the commands that grow beside them)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from grpoflow.config import GRPOConfig, load_config, parse_overrides

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
        description="Run GRPO. With no arguments, the embedded default (tiny model, echo task, CPU).",
        epilog="Options (YAML keys or --key value):" + describe_options(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="a YAML recipe, or the name of a packaged recipe")
    known, rest = parser.parse_known_args(argv)
    from grpoflow.launch import build_trainer, run

    try:
        overrides = parse_overrides(rest)
        config = load_config(resolve_recipe(known.config, overrides), overrides)
        trainer = build_trainer(config)
    except ValueError as error:
        print(f"grpoflow train: {error}", file=sys.stderr)
        return 2
    history = run(config, trainer)
    if history:
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
    from grpoflow.launch import export_checkpoint

    try:
        output = export_checkpoint(args.checkpoint, args.output, base=args.base)
    except ValueError as error:
        print(f"grpoflow export: {error}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {output}")
    return 0


COMMANDS = {"train": train, "export": export}
USAGE = (
    "usage: grpoflow {train} [options]   (grpoflow train --help)\n"
    "       grpoflow {export} --checkpoint DIR --output OUT [--base MODEL]"
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
