"""Warnings about single episodes, logged once per rollout: one line per distinct message with the
number of episodes it concerns, instead of one line per episode (a failing environment would
otherwise repeat the same line for every episode of every step)."""

from __future__ import annotations

import logging
from collections import Counter


class GroupedWarnings:
    """Collects the warnings of one rollout and logs each distinct one once, with its count."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.counts: Counter[str] = Counter()

    def add(self, message: str) -> None:
        """One episode's warning (logged at `flush`)."""
        self.counts[message] += 1

    def flush(self) -> None:
        """Log each distinct warning once, in the order first seen, and forget them."""
        for message, count in self.counts.items():
            episodes = "1 episode" if count == 1 else f"{count} episodes"
            self.logger.warning("%s: %s", episodes, message)
        self.counts.clear()
