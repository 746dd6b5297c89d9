"""User code named in a config: `package.module:name`, `package.module.name` or
`path/to/file.py:name` (rewards, tools, environments, rollout functions); and the optional
packages an option needs, checked before any work.

A file is executed once as a module named after its resolved path, so what it registers takes
effect once, and what it defines pickles by reference to that module name (worker processes
re-import the same file to unpickle it). Its directory joins the end of `sys.path`, as a script's
does (at the front), so that it imports the modules beside it.

Objects a Python script hands to its run (`GRPOTrainer(tools=[fn])`) are provided under their
import paths while the run is built (`provided_for_now`), so functions and classes defined in the
script itself, which no module can import, reach the run as they are.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

PLUGIN_MODULE_PREFIX = "grpoflow_plugin_"
"""Module names of files imported by path start with this."""

PROVIDED: dict[str, Any] = {}
"""Objects given in Python, by the import path that names them, while their run is built."""


@contextlib.contextmanager
def provided_for_now(objects: Mapping[str, Any]) -> Iterator[None]:
    """`load_object` gives these objects for their import paths while the block runs; then each
    path means what it meant before (an import, or an object provided by an enclosing block)."""
    before = {spec: PROVIDED[spec] for spec in objects if spec in PROVIDED}
    PROVIDED.update(objects)
    try:
        yield
    finally:
        for spec in objects:
            PROVIDED.pop(spec, None)
        PROVIDED.update(before)


def require_extra(packages: Sequence[str], extra: str, needed_by: str) -> None:
    """ValueError naming the missing ones of `packages` (import names) and the extra of grpoflow
    that installs them, when any is missing; `needed_by` says what needs them."""
    missing = [name for name in packages if not _installed(name)]
    if missing:
        raise ValueError(
            f"{needed_by} needs {', '.join(missing)}, not installed: pip install 'grpoflow[{extra}]'"
        )


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # in sys.modules without a spec
        return package in sys.modules and sys.modules[package] is not None


def import_file(
    path: str | Path, what: str = "Plugin", prepare: Callable[[ModuleType], None] | None = None
) -> ModuleType:
    """Import a .py file as a module named after its resolved path (cached in sys.modules);
    `prepare` may fill the module's namespace before it runs. `what` names the file in errors."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ValueError(f"{what} file {str(path)!r} does not exist (resolved to {resolved}); fix the path.")
    name = module_name(resolved)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what} {str(path)!r} is not a Python file; give a path ending in .py.")
    module = importlib.util.module_from_spec(spec)
    if str(resolved.parent) not in sys.path:
        sys.path.append(str(resolved.parent))
    if prepare is not None:
        prepare(module)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[name]
        raise ImportFailed(
            f"{what} {str(path)!r} failed to import: {type(error).__name__}: {error}.", error
        ) from error
    return module


class ImportFailed(ValueError):
    """A user's file or module raised while it was imported; `cause` is what it raised."""

    def __init__(self, message: str, cause: BaseException) -> None:
        super().__init__(message)
        self.cause = cause


def load_object(spec: str, what: str, import_module_file: Callable[[str], ModuleType] | None = None) -> Any:
    """The object an import path names (`what` names it in errors, e.g. "Tool"): one provided
    under that path (`provided_for_now`), else the import's."""
    if spec in PROVIDED:
        return PROVIDED[spec]
    module_path, attribute = split_spec(spec, what)
    module = _import_module(spec, module_path, what, import_module_file)
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ValueError(
                f"{what} {spec!r}: {module_path!r} has no attribute {attribute!r}; fix the name. "
                f"Callables it defines: {', '.join(defined) or '(none)'}."
            )
        obj = getattr(obj, part)
    return obj


def split_spec(spec: str, what: str) -> tuple[str, str]:
    """(module or file, attribute) of an import path; ValueError for one that names no attribute."""
    if ":" in spec:
        module_path, attribute = spec.rsplit(":", 1)
    elif spec.endswith(".py"):
        raise ValueError(f"{what} {spec!r}: name the object in the file, as '{spec}:name'.")
    elif "." in spec:
        module_path, attribute = spec.rsplit(".", 1)
    else:
        module_path, attribute = "", spec
    if not module_path or not attribute:
        raise ValueError(f"{what} {spec!r}: write 'package.module:name' or 'path/to/file.py:name'.")
    return module_path, attribute


def is_file_path(module_path: str) -> bool:
    return module_path.endswith(".py") or "/" in module_path or "\\" in module_path


def module_name(path: Path) -> str:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    return f"{PLUGIN_MODULE_PREFIX}{stem}_{digest}"


def _import_module(
    spec: str, module_path: str, what: str, import_module_file: Callable[[str], ModuleType] | None
) -> ModuleType:
    if is_file_path(module_path):
        return (import_module_file or (lambda path: import_file(path, what)))(module_path)
    try:
        return importlib.import_module(module_path)
    except Exception as error:
        raise ValueError(
            f"{what} {spec!r}: importing module {module_path!r} failed: {type(error).__name__}: {error}. "
            "Install it or add its folder to PYTHONPATH, or give a file path ('path/to/file.py:name')."
        ) from error
