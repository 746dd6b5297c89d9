"""One run per output directory.

A run writes `run.json` (its id) into its output directory and its id into each checkpoint's
marker. Before any work, `claim_output_dir` decides what the run may do there:

* a new run refuses a directory holding another run's files (checkpoints, metrics, run.json)
  unless `overwrite_output_dir`, which deletes those files, and only those, when training starts;
  a run that left no checkpoint and logged no step (it stopped while it was built, or during its
  first step) holds nothing to keep, so a new run starts over it, saying so;
* `resume_from_checkpoint latest` resumes the newest checkpoint of the directory's own run;
* a resumed run continues the id of the checkpoint it starts from, and its metrics files are cut
  back to that step, so a step is never logged twice. Resuming from an older checkpoint than the
  run's newest would overwrite the later ones, so it needs `overwrite_output_dir` too.

Nothing is written until `RunClaim.apply`, so a run that fails while it is built leaves the
directory as it was.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpoflow.report.run_files import COMPLETIONS_FILE, METRICS_FILE, RUN_FILE
from grpoflow.run.checkpoint import checkpoint_run_id, checkpoint_step, list_checkpoints, resolve_checkpoint

logger = logging.getLogger("grpoflow")

LOG_FILES = (METRICS_FILE, COMPLETIONS_FILE)
"""Files of one row per logged step, each row with its `step`."""
RUN_FILES = (RUN_FILE, *LOG_FILES, "runs", "report.html")
"""What a run writes into its output directory besides checkpoints (`runs` is TensorBoard's,
`report.html` the run report's)."""


@dataclass(frozen=True, slots=True)
class RunClaim:
    """What a run does with its output directory (see the module docstring)."""

    output_dir: Path
    run_id: str
    resume: Path | None = None
    """The checkpoint the run resumes from."""
    resume_step: int = 0
    discard: list[Path] = field(default_factory=list)
    """Files of another run (or of this run past `resume_step`) deleted by `apply`."""

    def apply(self, settings: dict[str, Any] | None = None, chosen: dict[str, Any] | None = None) -> None:
        """Delete what is discarded, record the run (with its `settings`, the flat config, for
        tools that read the directory such as its report, and the speed settings' values and
        sources, `chosen`), cut its logs back to `resume_step`."""
        for path in self.discard:
            _delete(path)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        record = {"run_id": self.run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if self.resume is not None:
            record["resumed_from"] = str(self.resume)
        if settings is not None:
            record["config"] = settings
        if chosen is not None:
            record["chosen_settings"] = chosen
        _write_atomically(self.output_dir / RUN_FILE, json.dumps(record, default=str) + "\n")
        for name in LOG_FILES:
            cut_log(self.output_dir / name, self.resume_step)


def _delete(path: Path) -> None:
    """Delete one of a run's files or directories; a symbolic link is removed, never followed, so
    nothing outside the output directory is touched. ValueError naming the path when it cannot be."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path)
    except OSError as error:
        raise ValueError(
            f"overwrite_output_dir could not delete {path} ({error.strerror or error}): remove it by "
            "hand, or choose another output_dir"
        ) from None


def claim_output_dir(output_dir: str | Path, resume_from_checkpoint: str | None, overwrite: bool) -> RunClaim:
    """Decide, without writing anything, what a run may do in `output_dir` (ValueError when the
    directory belongs to another run and neither `overwrite` nor a resume says what to do)."""
    directory = Path(output_dir)
    owner = run_id_of(directory)
    if not resume_from_checkpoint:
        traces = run_files(directory)
        if traces and not overwrite:
            _refuse_or_start_over(directory, traces)
        return RunClaim(directory, new_run_id(), discard=traces)
    if resume_from_checkpoint.lower() in {"latest", "true", "auto"}:
        resume = _latest_of(directory, owner, resume_from_checkpoint)
    else:
        resume = resolve_checkpoint(resume_from_checkpoint, directory)
    step, resume_run = checkpoint_step(resume), checkpoint_run_id(resume)
    if not _same_run(directory, owner, resume, resume_run):
        if not overwrite:
            raise ValueError(
                f"output_dir {directory} holds another run than the one of {resume}; resume into a "
                "new --output_dir, or set --overwrite_output_dir true to delete the other run's files"
            )
        discard = [path for path in run_files(directory) if path.resolve() != resume.resolve()]
        return RunClaim(directory, resume_run or new_run_id(), resume, step, discard)
    run_id = resume_run or owner or new_run_id()
    later = [
        path
        for path in list_checkpoints(directory)
        if checkpoint_step(path) > step and checkpoint_run_id(path) in (run_id, None)
    ]
    if later and not overwrite:
        raise ValueError(
            f"resume_from_checkpoint {resume} is older than {later[-1]} of the same run; resuming would "
            "overwrite the later checkpoints and their metrics. Resume from the newest (latest), or "
            f"set --overwrite_output_dir true to delete the checkpoints after step {step}"
        )
    return RunClaim(directory, run_id, resume, step, later)


def _refuse_or_start_over(directory: Path, traces: list[Path]) -> None:
    """ValueError for a directory holding another run's checkpoints or logged steps; for one that
    holds neither, a line saying the new run starts over it."""
    checkpoints = [path for path in traces if path.name.startswith(("checkpoint-", ".tmp-checkpoint-"))]
    if not checkpoints and not any(_logged_steps(directory / name) for name in LOG_FILES):
        logger.info(
            "output_dir %s holds a run that stopped before its first step (no checkpoint, no logged "
            "step): starting over there",
            directory,
        )
        return
    advice = (
        "Resume it with --resume_from_checkpoint latest, start over"
        if checkpoints
        else "It has no checkpoint to resume: start over"
    )
    raise ValueError(
        f"output_dir {directory} holds another run ({_describe(traces)}). {advice} with "
        "--overwrite_output_dir true (deletes its checkpoints and logs), or choose another --output_dir"
    )


def _logged_steps(path: Path) -> bool:
    """Whether a step log holds a row."""
    try:
        with path.open(encoding="utf-8") as lines:
            return any(line.strip() for line in lines)
    except OSError:
        return False


def _same_run(directory: Path, owner: str | None, resume: Path, resume_run: str | None) -> bool:
    """Whether resuming `resume` into `directory` continues the run the directory holds (an
    empty directory holds none, so any resume continues there)."""
    if resume.resolve().parent == directory.resolve():
        return owner is None or resume_run in (owner, None)
    return (owner is not None and resume_run == owner) or not run_files(directory)


def run_id_of(directory: Path) -> str | None:
    """The id in the directory's run.json; None when there is none."""
    try:
        record = json.loads((directory / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record.get("run_id") if isinstance(record, dict) else None


def run_files(directory: Path) -> list[Path]:
    """What runs have written into `directory`: checkpoints (complete or not) and `RUN_FILES`."""
    if not directory.is_dir():
        return []
    return sorted(
        path
        for path in directory.iterdir()
        if path.name in RUN_FILES or path.name.startswith(("checkpoint-", ".tmp-checkpoint-"))
    )


def new_run_id() -> str:
    return uuid.uuid4().hex


def cut_log(path: Path, last_step: int) -> None:
    """Drop the rows of a step log after `last_step` (all of them for 0)."""
    if not path.is_file():
        return
    kept = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            try:
                step = json.loads(line).get("step", 0)
            except ValueError:
                continue  # a line cut short by a crash
            if step <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    _write_atomically(path, "".join(kept))


def _latest_of(directory: Path, owner: str | None, spec: str) -> Path:
    found = list_checkpoints(directory)
    ours = [path for path in found if checkpoint_run_id(path) in (owner, None)] if owner else found
    if not ours:
        raise ValueError(
            f"resume_from_checkpoint={spec}: no complete checkpoint of this run in {directory}, so there is "
            "nothing to resume; start the run afresh without --resume_from_checkpoint (add "
            "--overwrite_output_dir true if the directory holds its logged steps), or choose another "
            "--output_dir"
        )
    if len(ours) < len(found):
        logger.warning(
            "%s holds checkpoints of other runs (%s); they are not resumed",
            directory,
            ", ".join(path.name for path in found if path not in ours),
        )
    return ours[-1]


def _describe(paths: list[Path]) -> str:
    checkpoints = [path.name for path in paths if path.name.startswith("checkpoint-")]
    others = [path.name for path in paths if not path.name.startswith("checkpoint-")]
    plural = "s" if len(checkpoints) > 1 else ""
    newest = max(checkpoints, key=_step_key) if checkpoints else ""
    parts = [f"{len(checkpoints)} checkpoint{plural} up to {newest}"] if checkpoints else []
    return ", ".join(parts + others)


def _step_key(name: str) -> int:
    suffix = name.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else -1


def _write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)
