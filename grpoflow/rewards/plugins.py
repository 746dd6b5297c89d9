"""Rewards from outside the package: plugin files and import paths.

A plugin file is executed once as a module named after its path, so the `register_reward` calls
and `orms[...] = ...` assignments in it take effect. `orms` and `ORM` are predefined in its
namespace; a file that builds its own `orms` dict has that dict's entries registered afterwards.

Functions defined in a plugin file pickle by reference to that module name; the runner re-imports
the same files in its process-pool workers, so plugin functions marked `cpu_heavy` can run there.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

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

PLUGIN_MODULE_PREFIX = "grpoflow_plugin_"
"""Module names of plugin files start with this."""


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
    """Import a .py file as a module named after its resolved path (cached in sys.modules)."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ValueError(
            f"Reward plugin file {str(path)!r} does not exist (resolved to {resolved}); fix the path."
        )
    name = _module_name(resolved)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ValueError(f"Reward plugin {str(path)!r} is not a Python file; give a path ending in .py.")
    module = importlib.util.module_from_spec(spec)
    module.orms = orms
    module.ORM = ORM
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[name]
        hint = ""
        if isinstance(error, ImportError) and "swift" in str(error):
            hint = (
                " Replace `from swift.plugin import ORM, orms` with `from grpoflow.rewards import ORM, orms`."
            )
        raise ValueError(
            f"Reward plugin {str(path)!r} failed to import: {type(error).__name__}: {error}.{hint}"
        ) from error
    return module


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
    module_path, attribute = _split_spec(spec)
    module = _import_module(spec, module_path)
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ValueError(
                f"Reward {spec!r}: {module_path!r} has no attribute {attribute!r}; fix the name. "
                f"Callables it defines: {', '.join(defined) or '(none)'}."
            )
        obj = getattr(obj, part)
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
        if module is not None and module.__name__.startswith(PLUGIN_MODULE_PREFIX):
            files.append(module.__file__)
    return sorted(set(files))


def _split_spec(spec: str) -> tuple[str, str]:
    if ":" in spec:
        module_path, attribute = spec.rsplit(":", 1)
    elif spec.endswith(".py"):
        raise ValueError(f"Reward {spec!r}: name the function in the file, as '{spec}:function_name'.")
    elif "." in spec:
        module_path, attribute = spec.rsplit(".", 1)
    else:
        get_reward(spec)  # raises the unknown-name error listing the registered rewards
    if not module_path or not attribute:
        raise ValueError(f"Reward {spec!r}: write 'package.module:function' or 'path/to/file.py:function'.")
    return module_path, attribute


def _import_module(spec: str, module_path: str) -> ModuleType:
    if module_path.endswith(".py") or "/" in module_path or "\\" in module_path:
        return import_file(module_path)
    try:
        return importlib.import_module(module_path)
    except Exception as error:
        raise ValueError(
            f"Reward {spec!r}: importing module {module_path!r} failed: {type(error).__name__}: {error}. "
            "Install it or add its folder to PYTHONPATH, or give a file path ('path/to/file.py:function')."
        ) from error


def _module_name(path: Path) -> str:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    return f"{PLUGIN_MODULE_PREFIX}{stem}_{digest}"
