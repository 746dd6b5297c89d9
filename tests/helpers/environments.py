"""Environment classes shared by the agent tests."""

from __future__ import annotations


class Shout:
    """A second environment class: answers the first turn in words, then ends; keeps its reset row."""

    def reset(self, **row):
        self.row, self.turns = row, 0

    def respond(self, text):
        self.turns += 1
        return "LOUDER" if self.turns == 1 else None

    def get_reward(self) -> float:
        return float(self.turns)
