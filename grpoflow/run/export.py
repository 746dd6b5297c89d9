"""Writing a training checkpoint as a standalone model, loadable by
`AutoModelForCausalLM.from_pretrained` (`grpoflow export`)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from grpoflow.policy import adapter_checkpoints
from grpoflow.policy.loading import PolicyConfig, load_model, load_tokenizer, resolve_dtype
from grpoflow.policy.tiny import DEFAULT_SEED
from grpoflow.run import checkpoint

logger = logging.getLogger("grpoflow")


def export_checkpoint(checkpoint_dir: str | Path, output_dir: str | Path, *, base: str | None = None) -> Path:
    """Write a checkpoint as a standalone model (`save_pretrained`, with the tokenizer) into
    `output_dir`, loadable by `AutoModelForCausalLM.from_pretrained`.

    An adapter checkpoint is merged into its base model: `base`, or the model of the run that
    wrote it (from its saved config; `tiny` and `random:*` are rebuilt from the run's seed), in
    the run's `torch_dtype` (auto: the base model's own). A full checkpoint is copied as it is.
    """
    directory, output = Path(checkpoint_dir), Path(output_dir)
    if not checkpoint.is_checkpoint(directory):
        raise ValueError(
            f"{directory} is not a complete checkpoint directory (it needs {checkpoint.MARKER} and "
            f"{checkpoint.STATE_FILE}): give a checkpoint-N directory of a run's output_dir"
        )
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"output {output} already exists and is not an empty directory: choose another")
    if not adapter_checkpoints.is_adapter_checkpoint(directory):
        if base is not None:
            logger.warning("--base %s is ignored: %s holds a full model, copied as it is", base, directory)
        output.mkdir(parents=True, exist_ok=True)
        for path in directory.iterdir():
            if path.is_file() and path.name not in checkpoint.RUN_FILES:
                shutil.copy2(path, output / path.name)
        return output
    tokenizer = load_tokenizer(str(directory))
    model = adapter_base(directory, base, vocab_size=len(tokenizer))
    adapter_checkpoints.merge_adapter_checkpoint(model, directory).save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output


def adapter_base(
    directory: Path, base: str | None, *, vocab_size: int, device: torch.device | None = None
) -> torch.nn.Module:
    """The base model of an adapter checkpoint, on `device` (the CPU), as its run loaded it."""
    run_config = checkpoint.load_trainer_state(directory).get("config", {})
    source = base or run_config.get("model")
    if not source:
        raise ValueError(f"{directory} names no base model in its saved config: pass --base MODEL")
    dtype_name = run_config.get("torch_dtype", "auto")
    cpu = device or torch.device("cpu")
    return load_model(
        source,
        PolicyConfig(model=source, trust_remote_code=run_config.get("trust_remote_code", False)),
        vocab_size=vocab_size,
        seed=run_config.get("seed", DEFAULT_SEED),
        device=cpu,
        dtype="auto" if dtype_name == "auto" else resolve_dtype(dtype_name, cpu),
    )
