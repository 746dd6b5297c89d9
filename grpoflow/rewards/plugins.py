"""Rewards from outside the package: plugin files and import paths.

A plugin file is executed once as a module named after its path, so the `register_reward` calls
and `orms[...] = ...` assignments in it take effect. `orms` and `ORM` are predefined in its
namespace; a file that builds its own `orms` dict has that dict's entries registered afterwards.

Functions defined in a plugin file pickle by reference to that module name; the runner re-imports
the same files in its process-pool workers, so plugin functions marked `cpu_heavy` can run there.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from grpoflow import imports
from grpoflow.rewards.params import RewardConfig
from grpoflow.rewards.registry import (
    ORM,
    REWARD_REGISTRY,
    RewardFn,
    get_reward,
    instantiate,
    orms,
    register_reward,
)


def load_plugins(paths: Iterable[str | Path]) -> list[ModuleType]:
    """Execute plugin files by path (each once) so their rewards are registered; returns the modules."""
    modules = []
    for path in paths:
        module = import_file(path)
        local_table = getattr(module, "orms", orms)
        if local_table is not orms and isinstance(local_table, dict):
            for name, obj in local_table.items():
                register_reward(name)(obj)
        modules.append(module)
    return modules


def import_file(path: str | Path) -> ModuleType:
    """Import a reward plugin file (see `grpoflow.imports.import_file`), `orms` and `ORM` predefined."""

    def prepare(module: ModuleType) -> None:
        module.orms = orms
        module.ORM = ORM

    try:
        return imports.import_file(path, "Reward plugin", prepare)
    except imports.ImportFailed as failure:
        if isinstance(failure.cause, ImportError) and "swift" in str(failure.cause):
            raise ValueError(
                f"{failure} Replace `from swift.plugin import ORM, orms` with "
                "`from grpoflow.rewards import ORM, orms`."
            ) from failure.cause
        raise


def resolve_reward(spec: str | Callable[..., Any], config: RewardConfig | None = None) -> RewardFn:
    """The reward function `spec` names.

    `spec` is a registered name, an import path (`package.module:function`,
    `package.module.function` or `path/to/file.py:function`), or already a callable. A class is
    instantiated (with `config` when its `__init__` takes an argument); a function is returned
    unchanged, so TRL reward functions work as they are.
    """
    config = config if config is not None else RewardConfig()
    if inspect.isclass(spec):
        return instantiate(spec, config)
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"A reward spec must be a name, an import path or a callable, got {spec!r}")
    if spec in REWARD_REGISTRY:
        return get_reward(spec, config)
    if ":" not in spec and "." not in spec:
        get_reward(spec)  # raises the unknown-name error listing the registered rewards
    obj = imports.load_object(spec, "Reward", import_file)
    if inspect.isclass(obj):
        return instantiate(obj, config)
    if not callable(obj):
        raise ValueError(
            f"Reward {spec!r} is a {type(obj).__name__}, not callable; point it at a function or a class."
        )
    return obj


def plugin_files(funcs: Iterable[Callable[..., Any]]) -> list[str]:
    """Files of the plugin modules that define `funcs` (for re-importing them in worker processes)."""
    files = []
    for fn in funcs:
        module = sys.modules.get(getattr(fn, "__module__", None) or type(fn).__module__)
        if module is not None and module.__name__.startswith(imports.PLUGIN_MODULE_PREFIX):
            files.append(module.__file__)
    return sorted(set(files))
