"""Atomic, rotating checkpoints that resume a run exactly.

A checkpoint is written into a hidden temporary directory beside its final place, a `COMPLETE`
marker goes in last, and one `rename` publishes it: a crash mid-save leaves only a temporary
directory, which the next save clears, never a half-written `checkpoint-N`.

A checkpoint holds the model (a LoRA run's: the adapter only, PEFT's `save_pretrained`), the
tokenizer and the trainer state (`trainer_state.json` and its tensors in `trainer_state.tensors`,
no pickle: `state_files.py`; it keeps the run's config and, for a run
over several processes, every rank's RNG state). Rank 0 writes it; the weights, optimizer and data
position are the same on every rank (under FSDP, gathered from every rank's shards first).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpoflow.distributed import DistributedContext
from grpoflow.phases import phase
from grpoflow.policy.lora import is_peft_model
from grpoflow.policy.placement import Placement
from grpoflow.run.state_files import (
    LEGACY_STATE_FILE,
    STATE_FILE,
    TENSORS_FILE,
    has_state,
    load_state,
    save_state,
)

logger = logging.getLogger("grpoflow.run.checkpoint")

MARKER = "COMPLETE"
_NAME = re.compile(r"^checkpoint-(\d+)$")
BEST = "checkpoint-best"
"""The copy of the checkpoint with the best metric_for_best_model, beside the rotating ones."""
RUN_FILES = frozenset({MARKER, STATE_FILE, TENSORS_FILE, LEGACY_STATE_FILE})
"""A checkpoint's files that are the run's, not the model's (an export leaves them out)."""


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_rng_state(trainer_state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The RNG state rank `rank` resumes with: its own when the checkpoint's run had as many ranks
    (`rng_per_rank`), else rank 0's."""
    per_rank = trainer_state.get("rng_per_rank") or [trainer_state["rng"]]
    if len(per_rank) == world_size:
        return per_rank[rank]
    if rank == 0:
        logger.warning(
            "the checkpoint was written by %d processes and is resumed by %d: every rank restarts "
            "from rank 0's RNG state, and the run does not replay the uninterrupted one step for step",
            len(per_rank),
            world_size,
        )
    return per_rank[0]


def save_placed_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    placement: Placement,
    tokenizer,
    trainer_state: dict[str, Any],
    distributed: DistributedContext,
    save_total_limit: int | None = None,
    run_id: str | None = None,
) -> Path:
    """`save_checkpoint` over every rank: each takes part in gathering the placed model's full
    weights and the RNG states (`trainer_state["rng"]`, kept per rank as `rng_per_rank`), rank 0
    writes, the others wait. Returns the checkpoint's path on every rank."""
    per_rank = distributed.gather_objects(trainer_state["rng"])
    weights = placement.full_state_dict()
    path = Path(output_dir) / f"checkpoint-{step}"
    if distributed.is_main:
        path = save_checkpoint(
            output_dir,
            step,
            model=placement.module,
            tokenizer=tokenizer,
            trainer_state={**trainer_state, "rng_per_rank": per_rank},
            save_total_limit=save_total_limit,
            state_dict=weights,
            run_id=run_id,
        )
    distributed.barrier()
    return path


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    model,
    tokenizer,
    trainer_state: dict[str, Any],
    save_total_limit: int | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    run_id: str | None = None,
) -> Path:
    """Write `output_dir/checkpoint-{step}` atomically, then drop the oldest beyond the limit.

    `state_dict`: the model's full weights when the model itself holds only shards (FSDP); the
    files written are the same as for a whole model. `run_id`: the run the checkpoint belongs to,
    kept in its marker (see `checkpoint_run_id`)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in output_dir.glob(".tmp-checkpoint-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = output_dir / f"checkpoint-{step}"
    staging = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    staging.mkdir()
    with _quiet_transformers():  # its "Writing model shards" bar would cut into the run's bar
        if is_peft_model(model):
            # The adapter only. Embeddings are never resized here, so PEFT need not fetch the base
            # model's config to find out whether to save them.
            model.save_pretrained(staging, save_embedding_layers=False, state_dict=state_dict)
        else:
            model.save_pretrained(staging, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
    save_state(trainer_state, staging)
    (staging / MARKER).write_text(json.dumps({"step": step, "run_id": run_id}))
    _fsync_tree(staging)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(output_dir)
    if save_total_limit is not None:
        # The one just written stays even when higher-numbered ones exist (a run resumed from an
        # older checkpoint); the oldest of the others go.
        others = [path for path in list_checkpoints(output_dir) if path != final]
        for old in others[: max(0, len(others) - save_total_limit + 1)]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def keep_as_best(checkpoint: str | Path, output_dir: str | Path) -> Path:
    """Copy the complete `checkpoint` to `output_dir/checkpoint-best`, replacing the previous best
    by renames only (a crash leaves one or the other whole, plus a temporary directory)."""
    output_dir = Path(output_dir)
    staging = output_dir / f".tmp-{BEST}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(checkpoint, staging)
    _fsync_tree(staging)
    best = output_dir / BEST
    previous = output_dir / f".tmp-{BEST}-previous-{os.getpid()}"
    if best.exists():
        os.replace(best, previous)
    os.replace(staging, best)
    _fsync_dir(output_dir)
    shutil.rmtree(previous, ignore_errors=True)
    return best


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        match = _NAME.match(path.name)
        if match and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resolve_checkpoint(spec: str | None, output_dir: str | Path) -> Path | None:
    """A checkpoint directory from `resume_from_checkpoint` (a path, or `latest`/`true`); None
    when it is unset."""
    if not spec:
        return None
    if spec.lower() in {"latest", "true", "auto"}:
        found = list_checkpoints(output_dir)
        if not found:
            raise ValueError(f"resume_from_checkpoint={spec}: no complete checkpoint in {output_dir}")
        return found[-1]
    path = Path(spec)
    if not is_checkpoint(path):
        raise ValueError(
            f"resume_from_checkpoint={spec} is not a complete checkpoint directory "
            f"(it needs {MARKER} and {STATE_FILE})"
        )
    return path


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a complete checkpoint directory."""
    path = Path(path)
    return (path / MARKER).is_file() and has_state(path)


def checkpoint_run_id(path: str | Path) -> str | None:
    """The id of the run that wrote a checkpoint; None for one written without it."""
    return _marker(path).get("run_id")


def checkpoint_step(path: str | Path) -> int:
    """The step a checkpoint was saved at: from its marker, else its name, else its state."""
    step = _marker(path).get("step")
    if isinstance(step, int):
        return step
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else int(load_trainer_state(path)["step"])


def _marker(path: str | Path) -> dict[str, Any]:
    try:
        record = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


BOOKKEEPING_KEYS = frozenset(
    {
        "output_dir",
        "overwrite_output_dir",
        "resume_from_checkpoint",
        "logging_steps",
        "log_completions",
        "report_to",
        "disable_tqdm",
        "html_report",
        "save_steps",
        "save_strategy",
        "save_total_limit",
    }
)
"""Keys that change where and how often a run reports and saves, not what it trains."""


def warn_about_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Warn when a run resumes with other settings than its checkpoint was written with (keys
    outside `BOOKKEEPING_KEYS`); the changed keys."""
    changed = sorted(
        key
        for key in saved.keys() & current.keys()
        if key not in BOOKKEEPING_KEYS and saved[key] != current[key]
    )
    if changed:
        logger.warning(
            "resuming with settings that differ from the checkpoint's: %s; the run goes on with the new ones",
            ", ".join(f"{key} {saved[key]!r} -> {current[key]!r}" for key in changed),
        )
    return changed


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer state of checkpoint `path`, read without running code (`state_files`)."""
    return load_state(Path(path))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@dataclass(kw_only=True)
class Checkpointer:
    """Where and when a run's checkpoints are written, and what each holds besides the trainer's
    state: the placed policy's full weights and the tokenizer."""

    output_dir: str | Path
    placement: Placement
    tokenizer: Any
    distributed: DistributedContext
    is_due: Callable[[int, int], bool]
    """`(step, total_steps)`: whether the step ends with a scheduled checkpoint."""
    save_total_limit: int | None = None
    run_id: str | None = None
    """Marks the run's checkpoints (`grpoflow.run.output_dir`)."""

    def save(self, step: int, trainer_state: dict[str, Any]) -> Path:
        """Write step `step`'s checkpoint (rank 0 writes, holding every rank's RNG state; the
        others wait)."""
        with phase("checkpoint"):
            return save_placed_checkpoint(
                self.output_dir,
                step,
                placement=self.placement,
                tokenizer=self.tokenizer,
                trainer_state=trainer_state,
                distributed=self.distributed,
                save_total_limit=self.save_total_limit,
                run_id=self.run_id,
            )

    def by_step(self) -> dict[int, Path]:
        """The run's checkpoints by step."""
        return {checkpoint_step(path): path for path in list_checkpoints(self.output_dir)}
