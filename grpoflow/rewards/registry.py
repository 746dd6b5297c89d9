"""Reward functions by name.

A reward function follows TRL's contract, so TRL reward functions work unchanged:

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

`prompts` and `completions` are strings, or lists of message dicts for conversational data;
`columns` holds the other dataset columns (lists as long as the batch) and any extra keyword
arguments of the caller, so every function must accept `**kwargs`. None or NaN means "no reward
for this sample". A function may set `cpu_heavy = True` to run in the runner's process pool.

The registry maps a name to a factory `(RewardConfig) -> reward function`. `register_reward`
accepts three kinds of objects:

* a class: instantiated with the RewardConfig when its `__init__` takes an argument, else with none;
* a function that takes `**kwargs`: a reward function itself (the contract requires `**kwargs`);
* any other function: a factory, called with the RewardConfig.

`orms` offers ms-swift's plugin idiom (`orms["name"] = SomeORMClass`) on top of the same registry.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

from grpoflow.rewards.params import RewardConfig

RewardFn = Callable[..., Any]
"""`fn(prompts, completions, completion_ids, **columns) -> list[float | None]` (or a coroutine of it)."""
RewardFactory = Callable[[RewardConfig], RewardFn]

REWARD_REGISTRY: dict[str, RewardFactory] = {}
"""Reward factories by name; fill it with `register_reward`."""

logger = logging.getLogger("grpoflow.rewards")


def register_reward(name: str) -> Callable[[Any], Any]:
    """Decorator registering a reward class, reward function or factory under `name`.

    The decorated object is returned unchanged. Registering a taken name replaces the old entry
    with a warning, so a plugin can override a built-in.

    Example:
        >>> @register_reward("short")
        ... def short(completions, **kwargs):
        ...     return [1.0 if len(c) < 100 else 0.0 for c in completions]
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_reward needs a non-empty string name, got {name!r}")

    def decorator(obj: Any) -> Any:
        _store(name, as_factory(obj), obj)
        return obj

    return decorator


def get_reward(name: str, config: RewardConfig | None = None) -> RewardFn:
    """Build the registered reward `name` with `config` (defaults when None)."""
    if name not in REWARD_REGISTRY:
        known = ", ".join(sorted(REWARD_REGISTRY)) or "(none)"
        close = difflib.get_close_matches(name, REWARD_REGISTRY, n=1)
        hint = f"; did you mean {close[0]}?" if close else "."
        raise ValueError(
            f"Unknown reward {name!r}{hint} Registered rewards: {known}. Register yours with "
            "@register_reward in a file named in external_plugins, or give an import path "
            "('package.module:function' or 'path/to/file.py:function')."
        )
    return REWARD_REGISTRY[name](config if config is not None else RewardConfig())


def as_factory(obj: Any) -> RewardFactory:
    """Turn a reward class, reward function or factory into a factory (rules in the module doc)."""
    if inspect.isclass(obj):
        return lambda config: instantiate(obj, config)
    if not callable(obj):
        raise ValueError(f"A reward must be a class or a callable, got {type(obj).__name__}: {obj!r}")
    if _takes_var_keyword(obj):
        return lambda config: obj
    return obj


def instantiate(cls: type, config: RewardConfig) -> RewardFn:
    """`cls(config)` when `cls.__init__` takes an argument, else `cls()`."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: try without arguments
        return cls()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes_argument = any(
        p.kind in positional or p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters
    )
    return cls(config) if takes_argument else cls()


class ORM:
    """Base class for ms-swift style reward classes (`orms["name"] = MyORM`); override `__call__`."""

    def __call__(self, completions: list, **kwargs: Any) -> list[float | None]:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(completions, **kwargs)")


class _OrmTable(MutableMapping):
    """ms-swift's `orms` dict: assigning `orms[name] = cls_or_fn` registers it as a reward."""

    def __init__(self) -> None:
        self._entries: dict[str, Any] = {}

    def __setitem__(self, name: str, obj: Any) -> None:
        register_reward(name)(obj)

    def __getitem__(self, name: str) -> Any:
        return self._entries[name]

    def __delitem__(self, name: str) -> None:
        del self._entries[name]
        REWARD_REGISTRY.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def _record(self, name: str, obj: Any) -> None:
        self._entries[name] = obj


orms = _OrmTable()
"""ms-swift compatible table: `orms["name"] = MyORM` registers `MyORM` under "name"."""


@contextlib.contextmanager
def registered_for_now(functions: Mapping[str, Any]) -> Iterator[None]:
    """Register `functions` (reward callables by name) while the block runs, then restore what
    each name meant before (nothing, or the earlier entry): a Python script's rewards serve its own
    run and do not outlive it, and one named like a built-in shadows it only meanwhile."""
    before = {name: (REWARD_REGISTRY.get(name), orms.get(name)) for name in functions}
    for name, function in functions.items():
        register_reward(name)(function)
    try:
        yield
    finally:
        for name, (factory, original) in before.items():
            if factory is None:
                del orms[name]  # the table's own removal: the entry and the registry's name
            else:
                REWARD_REGISTRY[name] = factory
                orms._record(name, original)


def _store(name: str, factory: RewardFactory, original: Any) -> None:
    if name in REWARD_REGISTRY and orms.get(name) is not original:
        logger.warning("Reward %r is registered again; the new definition replaces the old one.", name)
    REWARD_REGISTRY[name] = factory
    orms._record(name, original)


def _takes_var_keyword(fn: Callable) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
