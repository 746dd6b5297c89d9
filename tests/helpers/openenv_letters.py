"""A small OpenEnv environment for the tiny model: reset names a letter (chosen by the seed), each
step rewards the share of the action's first four characters equal to it and names the next
letter; the episode is done after `turns` steps."""

from __future__ import annotations

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

LETTERS = "abcdefgh"


class LetterAction(Action):
    message: str


class LetterObservation(Observation):
    instruction: str


class LetterEnvironment(Environment[LetterAction, LetterObservation, State]):
    def __init__(self, turns: int = 2) -> None:
        super().__init__()
        self.turns = turns
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> LetterObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.letter = LETTERS[(seed or 0) % len(LETTERS)]
        return LetterObservation(instruction=f"echo {self.letter}:")

    def step(self, action: LetterAction, timeout_s: float | None = None, **kwargs) -> LetterObservation:
        self._state.step_count += 1
        reward = sum(char == self.letter for char in action.message[:4]) / 4
        self.letter = LETTERS[(LETTERS.index(self.letter) + 1) % len(LETTERS)]
        done = self._state.step_count >= self.turns
        return LetterObservation(instruction=f"echo {self.letter}:", reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state
