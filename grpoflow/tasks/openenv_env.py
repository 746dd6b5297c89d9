"""OpenEnv environments in process: `--environment openenv:pkg.module:MyEnvironment` (or
`openenv:path/to/file.py:MyEnvironment`) names an OpenEnv `Environment` class; one instance plays
each episode through its own `reset` and `step`.

The episode's prompt is the row's (`prompt`, by default the environment's description) followed
by the text of the observation `reset` returns. Each policy turn becomes the environment's action
(its one text field, or the field `action_field` names) and `step` answers it: the observation's
text goes back to the policy until an observation says `done`. The episode's reward is the sum of
the steps' rewards (the `OpenEnvEnvironment` reward). An observation's text is its own fields
besides done, reward and metadata: the value of the only one, else `name: value` lines.

Arguments (`?key=value`): `size` (rows, 1000 by default; row i resets with seed i), `prompt` and
`action_field` are grpoflow's; every other one goes to the environment's constructor.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any

from grpoflow import imports
from grpoflow.tasks.library import LibrarySpec, import_library

LIBRARY = "openenv"
OWN_ARGS = ("size", "prompt", "action_field")
"""Arguments grpoflow reads; the rest are the environment's constructor's."""
DEFAULT_SIZE = 1000
HIDDEN_FIELDS = ("done", "reward", "metadata")
"""Observation fields that are not shown to the policy."""


@functools.cache
def environment_type(spec: LibrarySpec) -> tuple[type, type, str]:
    """The environment class a spec names, its action class and the action's text field."""
    interfaces = import_library(
        "openenv.core.env_server.interfaces", "openenv-core", f"environment {spec.text!r}"
    )
    cls = imports.load_object(spec.name, "OpenEnv environment")
    if not (inspect.isclass(cls) and issubclass(cls, interfaces.Environment)):
        raise ValueError(f"environment {spec.text!r}: {spec.name} is not an OpenEnv Environment class")
    action = _action_class(cls, spec)
    return cls, action, _text_field(action, spec)


def _action_class(cls: type, spec: LibrarySpec) -> type:
    hints = typing.get_type_hints(cls.step)
    action = hints.get("action")
    if not inspect.isclass(action):
        raise ValueError(
            f"environment {spec.text!r}: {cls.__name__}.step(action) has no Action class as its "
            "type hint, so a turn's text cannot become an action; annotate it"
        )
    return action


def _text_field(action: type, spec: LibrarySpec) -> str:
    fields = {name: field for name, field in action.model_fields.items() if name != "metadata"}
    chosen = spec.args.get("action_field")
    if chosen is None:
        text = [name for name, field in fields.items() if field.annotation is str]
        if len(text) != 1:
            raise ValueError(
                f"environment {spec.text!r}: {action.__name__} has {len(text)} text fields "
                f"({', '.join(text) or 'none'}); name the one a turn fills with ?action_field=NAME"
            )
        chosen = text[0]
    if chosen not in fields:
        raise ValueError(
            f"environment {spec.text!r}: {action.__name__} has no field {chosen!r} "
            f"(its fields: {', '.join(fields)})"
        )
    return chosen


def make_environment(spec: LibrarySpec) -> Any:
    """A fresh environment built with the spec's constructor arguments."""
    cls, _, _ = environment_type(spec)
    kwargs = {key: value for key, value in spec.args.items() if key not in OWN_ARGS}
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise ValueError(f"environment {spec.text!r}: {cls.__name__} cannot be built: {error}") from None


def load_rows(spec: LibrarySpec, split: str, seed: int) -> list[dict]:
    """`size` rows of the prompt, each with the seed its episode resets with."""
    size = spec.args.get("size", DEFAULT_SIZE)
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"environment {spec.text!r}: size must be a positive number of rows, not {size!r}")
    prompt = spec.args.get("prompt") or make_environment(spec).get_metadata().description
    return [{"prompt": str(prompt), "openenv_seed": index} for index in range(size)]


def environment_class(spec: LibrarySpec) -> type:
    """The episode class of one environment: `OpenEnvEnvironment` bound to it."""
    environment_type(spec)
    return type("OpenEnvEnvironment", (OpenEnvEnvironment,), {"spec": spec})


class OpenEnvEnvironment:
    """One episode of an OpenEnv environment, in grpoflow's environment protocol (see the module
    docstring)."""

    spec: LibrarySpec

    def reset(self, openenv_seed: int | None = None, **row: Any) -> str:
        self.environment = make_environment(self.spec)
        self.total, self.done = 0.0, False
        return "\n" + self._take(self.environment.reset(seed=openenv_seed))

    def respond(self, text: str) -> str | None:
        """The turn as the environment's action; the observation's text, or None once done."""
        if self.done:
            return None
        _, action, field = environment_type(self.spec)
        shown = self._take(self.environment.step(action(**{field: text})))
        return None if self.done else shown

    def get_reward(self) -> float:
        """The sum of the rewards of the episode's observations."""
        self._close()
        return self.total

    def _take(self, observation: Any) -> str:
        self.total += float(observation.reward or 0.0)
        if observation.done:
            self._close()
        return observation_text(observation)

    def _close(self) -> None:
        if not self.done:
            self.done = True
            self.environment.close()


def observation_text(observation: Any) -> str:
    """What the policy reads of an observation (see the module docstring)."""
    shown = {
        name: getattr(observation, name)
        for name in type(observation).model_fields
        if name not in HIDDEN_FIELDS
    }
    if len(shown) == 1:
        return str(next(iter(shown.values())))
    return "\n".join(f"{name}: {value}" for name, value in shown.items())
