"""A packaged multi-turn task: echo letters the environment names one turn at a time.

An episode starts from a prompt such as `echo c:`; the policy writes a turn (`max_turn_tokens`
characters); the environment scores it (the share of its characters equal to the letter) and
answers `echo f:` for the next letter, three letters in all. The reward is the mean score over the
three turns, so the policy must read what the environment says in the middle of the episode,
tokens it never samples and is never trained on. A fresh tiny model scores about 1/50.
"""

from __future__ import annotations

from grpoflow.tasks.echo import LETTERS, NUM_ROWS, split_rng

TURNS = 3
TURN_LENGTH = 4


def load_rows(split: str = "train") -> list[dict]:
    rng = split_rng("relay", split)
    rows = []
    for _ in range(NUM_ROWS[split]):
        letters = "".join(rng.choice(LETTERS) for _ in range(TURNS))
        rows.append({"prompt": f"echo {letters[0]}:", "letters": letters})
    return rows


class RelayEnvironment:
    """Names the next letter after each turn and scores the episode (`get_reward`)."""

    def reset(self, letters: str, **row) -> None:
        self.letters, self.scores = letters, []

    def respond(self, text: str) -> str | None:
        """Score the turn; the next instruction, or None after the last letter."""
        target = self.letters[len(self.scores)]
        self.scores.append(sum(char == target for char in text[:TURN_LENGTH]) / TURN_LENGTH)
        if len(self.scores) == len(self.letters):
            return None
        return f"echo {self.letters[len(self.scores)]}:"

    def get_reward(self) -> float:
        """Mean turn score over all letters (a turn never written scores 0)."""
        return sum(self.scores) / len(self.letters)
