"""Datasets, chat templates and prompt batches.

Rows come from a packaged task, a local file (jsonl/json/parquet/csv) or a hub dataset. The prompt
is the first of the columns `prompt`, `problem`, `question`, `messages`; a list of chat messages
makes the row conversational. Every other column reaches the reward functions. Prompts are
tokenized once, up front, so that over-long and empty prompts are reported before training starts.
"""

from __future__ import annotations

import difflib
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from grpoflow import hub
from grpoflow.options import require
from grpoflow.tasks import TASKS, library_rows


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where prompts come from and how they become token ids."""

    dataset: list[str] = field(default_factory=list)
    """Datasets: a packaged task (echo, gsm8k), another library's task
    (`reasoning_gym:basic_arithmetic`, grpoflow.tasks.library), a local jsonl/json/parquet/csv
    file or a hub dataset; `NAME#N` takes N rows."""
    dataset_split: str = "train"
    """Split of hub datasets and packaged tasks."""
    system: str | None = None
    """System prompt: text, or the path of a file holding it."""
    max_prompt_length: int = 512
    """Longest prompt in tokens; longer ones follow truncation_strategy."""
    truncation_strategy: Literal["delete", "left", "raise"] = "delete"
    """Prompts over max_prompt_length: delete (skip, reported), left (keep the end), raise."""
    dataset_shuffle: bool = True
    """Shuffle prompts each epoch."""

    def __post_init__(self) -> None:
        require(self.max_prompt_length > 0, "max_prompt_length", "> 0", self.max_prompt_length)

    def load_prompts(self, tokenizer, *, seed: int) -> list[PromptItem]:
        """Every dataset's rows as tokenized prompts (see `build_prompt_items`)."""
        rows = [row for spec in self.dataset for row in load_rows(spec, self.dataset_split, seed=seed)]
        return build_prompt_items(
            rows,
            tokenizer,
            system=read_system_prompt(self.system),
            max_prompt_length=self.max_prompt_length,
            truncation_strategy=self.truncation_strategy,
        )


logger = logging.getLogger("grpoflow.data.prompts")

PROMPT_COLUMNS = ("prompt", "problem", "question", "messages")
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(slots=True)
class PromptItem:
    """One prompt ready for generation."""

    prompt: str | list[dict]
    """What reward functions receive as the prompt: text, or chat messages."""
    prompt_ids: list[int]
    """Token ids fed to the engine (chat template applied where the model has one)."""
    columns: dict[str, Any] = field(default_factory=dict)
    """The row's other columns."""


def load_rows(spec: str, split: str = "train", seed: int = 0) -> list[dict]:
    """Rows of one dataset spec: `echo`, `gsm8k`, `reasoning_gym:basic_arithmetic`,
    `path/to/file.jsonl`, `org/name`, each optionally with `#N` to take N rows (sampled with `seed`
    when N is below the size)."""
    name, hash_sign, count = spec.partition("#")
    if hash_sign and (not count.isdigit() or int(count) < 1):
        raise ValueError(f"dataset {spec!r}: the part after '#' must be a positive row count")
    path = Path(name)
    library = library_rows(name, split, seed)
    if library is not None:
        rows = library
    elif name in TASKS:
        rows = TASKS[name](split)
    elif path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise ValueError(f"dataset file {path} does not exist")
        rows = _read_local(path)
    elif path.exists():
        raise ValueError(f"dataset {path}: use a .jsonl, .json, .parquet or .csv file")
    else:
        rows = _read_hub(name, split)
    if count and int(count) < len(rows):
        rows = random.Random(seed).sample(rows, int(count))
    if not rows:
        raise ValueError(f"dataset {spec!r} has no rows")
    return rows


def _read_local(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not valid JSON ({error.msg})") from None
        return rows
    if path.suffix == ".json":
        loaded = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(loaded, list):
            raise ValueError(f"{path} must hold a JSON list of rows")
        return loaded
    return (
        _datasets_module().load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path))["train"].to_list()
    )


def _read_hub(name: str, split: str) -> list[dict]:
    close = difflib.get_close_matches(name, TASKS, n=1, cutoff=0.75)
    if close and "/" not in name:
        raise ValueError(
            f"dataset {name!r} is not a packaged task ({', '.join(TASKS)}) nor a local file; did you mean "
            f"{close[0]!r}? (a hub dataset is named org/name)"
        )
    if hub.unreachable():
        raise ValueError(
            hub.unreachable_message(f"dataset {name!r}") + f" (packaged tasks: {', '.join(TASKS)})"
        )
    try:
        return _datasets_module().load_dataset(name, split=split).to_list()
    except Exception as error:
        raise ValueError(
            f"dataset {name!r} is not a packaged task ({', '.join(TASKS)}), a local file, nor a "
            f"loadable hub dataset: {error}"
        ) from None


def _datasets_module():
    try:
        import datasets
    except ImportError:
        raise ValueError("this dataset needs the `datasets` package: pip install datasets") from None
    return datasets


def read_system_prompt(system: str | None) -> str | None:
    """`system` as given, or the contents of the file it names."""
    try:
        is_file = bool(system) and len(system) < 4096 and Path(system).is_file()
    except (OSError, ValueError):  # text no file system accepts as a name (too long, NUL bytes)
        is_file = False
    if is_file:
        return Path(system).read_text(encoding="utf-8").strip()
    return system


def build_prompt_items(
    rows: Sequence[dict],
    tokenizer,
    *,
    system: str | None,
    max_prompt_length: int,
    truncation_strategy: str,
) -> list[PromptItem]:
    """Tokenize every row's prompt, reporting (never silently dropping) the rows that fail. A text
    prompt that recurs is tokenized once."""
    items, problems, truncated = [], [], 0
    encoded: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        try:
            prompt, columns = _split_row(row)
            if not isinstance(prompt, str):
                ids = encode_prompt(tokenizer, prompt, system)
            else:
                if prompt not in encoded:
                    encoded[prompt] = encode_prompt(tokenizer, prompt, system)
                ids = list(encoded[prompt])
        except ValueError as error:
            problems.append(f"row {index}: {error}")
            continue
        if len(ids) > max_prompt_length:
            if truncation_strategy == "raise":
                raise ValueError(
                    f"row {index}: prompt has {len(ids)} tokens > max_prompt_length="
                    f"{max_prompt_length}; raise max_prompt_length or set truncation_strategy "
                    "to delete or left"
                )
            if truncation_strategy == "delete":
                problems.append(
                    f"row {index}: prompt of {len(ids)} tokens > max_prompt_length={max_prompt_length}"
                )
                continue
            ids, truncated = ids[-max_prompt_length:], truncated + 1
        items.append(PromptItem(prompt=prompt, prompt_ids=ids, columns=columns))
    if problems:
        logger.warning(
            "skipped %d of %d rows: %s%s",
            len(problems),
            len(rows),
            "; ".join(problems[:5]),
            " ..." if len(problems) > 5 else "",
        )
    if truncated:
        logger.warning("truncated %d prompts on the left to %d tokens", truncated, max_prompt_length)
    if not items:
        raise ValueError(
            f"no usable prompts among {len(rows)} rows (first problem: {problems[0] if problems else '-'})"
        )
    return items


def _split_row(row: dict) -> tuple[str | list[dict], dict]:
    if not isinstance(row, dict):
        raise ValueError(f"expected a mapping of column to value, got {type(row).__name__}")
    column = next((name for name in PROMPT_COLUMNS if row.get(name) not in (None, "", [])), None)
    if column is None:
        raise ValueError(
            f"no prompt: a row needs one of the columns {', '.join(PROMPT_COLUMNS)} "
            f"(found {', '.join(row) or 'none'})"
        )
    prompt = row[column]
    columns = {key: value for key, value in row.items() if key != column}
    if isinstance(prompt, list):
        prompt = _check_messages(prompt)
        if prompt[-1]["role"] == "assistant":
            columns.setdefault("solution", prompt[-1]["content"])
            prompt = prompt[:-1]
        if not prompt:
            raise ValueError("the conversation holds no message before the assistant's")
    elif not isinstance(prompt, str):
        raise ValueError(f"column {column!r} must be text or a list of messages")
    return prompt, columns


def _check_messages(messages: list) -> list[dict]:
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError("chat messages must be mappings with 'role' and 'content'")
    return messages


def encode_prompt(
    tokenizer, prompt: str | list[dict], system: str | None, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of a prompt: through the chat template when the tokenizer has one (rendering
    the JSON schemas of `tools` where the template shows tools)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}, *messages]
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    if not isinstance(prompt, str):
        prompt = "\n".join(f"{message['role']}: {message['content']}" for message in prompt)
    text = f"{system}\n{prompt}" if system else prompt
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return ids


class PromptSampler:
    """Endless, resumable prompt order: a fresh permutation per epoch from (seed, epoch)."""

    def __init__(self, num_items: int, *, seed: int, shuffle: bool = True) -> None:
        self.num_items, self.seed, self.shuffle = num_items, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_items))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_items, generator=generator).tolist()

    def take(self, count: int) -> list[int]:
        """The next `count` item indices, moving into the next epoch when one ends."""
        indices = []
        while len(indices) < count:
            if self.position == self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            indices.append(self._order[self.position])
            self.position += 1
        return indices

    def take_shard(self, count: int, rank: int, world_size: int) -> list[int]:
        """Rank `rank`'s `count` indices out of the next `count * world_size`: every rank walks the
        same order and takes its own slice, so `world_size` ranks consume the prompts one process
        taking `count * world_size` would, in the same order."""
        return self.take(count * world_size)[rank * count : (rank + 1) * count]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()
