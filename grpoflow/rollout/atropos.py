"""A run's batches from Atropos: the scored groups its environments post to the trajectory API,
turned into the trainer's groups and rewards.

Atropos environments sample from the run's rollout server (`grpoflow serve`, which the trainer
syncs its weights to each step), score each group themselves and post it; the trainer takes one
batch per step instead of sampling prompts. A group's sequences are split at the longest prefix
they share that no trained token falls into: that prefix is the group's prompt, the rest of each
sequence its completion, with Atropos's mask as the loss mask (environment turns of multi-turn
episodes get no loss) and the environment's `inference_logprobs` as the sampling log-probs. The
environment's score is the one reward, `atropos`; groups keep the size their environment gave
them, and a sequence with the override `set_advantage_to_zero` trains with advantage 0.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from grpoflow.agents.atropos_client import AtroposClient, ScoredGroup
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion
from grpoflow.phases import phase
from grpoflow.rollout.groups import Group, ScoredGroups
from grpoflow.rollout.source import GroupSource

logger = logging.getLogger("grpoflow")

REWARD_NAME = "atropos"
"""The reward column holding the environments' scores."""
HONOURED_OVERRIDES = frozenset({"set_advantage_to_zero"})
"""Per-sequence overrides the trainer applies; others are warned about once."""


class AtroposGroups(GroupSource):
    """One batch of scored groups per step from Atropos's trajectory API."""

    reward_names = (REWARD_NAME,)
    reward_weights = torch.ones(1)

    def __init__(self, client: AtroposClient, tokenizer, *, policy_version: int = 0) -> None:
        self.client, self.tokenizer = client, tokenizer
        self.policy_version = policy_version
        """The trainer's step: the version the batch's sequences are taken to come from."""
        self._warned: set[str] = set()

    def start(self, total_steps: int, step: int) -> None:
        """Register the run as the API's trainer for steps `step + 1..total_steps`."""
        trainer_id = self.client.register(total_steps, step)
        logger.info(
            "registered with the Atropos API at %s as trainer %d (steps %d..%d)",
            self.client.url,
            trainer_id,
            step + 1,
            total_steps,
        )

    def next(self, step: int) -> ScoredGroups:
        """The next batch (waits for the environments to post enough groups; TimeoutError when
        none comes in `atropos_max_wait_seconds`)."""
        self.policy_version = step
        with phase("rollout_wait"):
            return self.take()

    def take(self) -> ScoredGroups:
        """The next batch the API hands out, as groups."""
        raw = self.client.next_batch()
        groups, scores, sizes, zeroed = [], [], [], []
        logprobs_everywhere = all(group.logprobs is not None for group in raw)
        if not logprobs_everywhere:
            self._warn_once(
                "logprobs",
                "Atropos groups without inference_logprobs: the importance-sampling correction is off "
                "for their batches (environments built on atroposlib's ManagedServer send them)",
            )
        for scored in raw:
            group = self._group(scored)
            if group is None:
                continue
            groups.append(group)
            scores.extend(scored.scores)
            sizes.append(len(scored.scores))
            zeroed.extend(self._zeroed(scored))
        if not groups:
            raise ValueError(
                f"a batch from the Atropos API at {self.client.url} held no group whose sequences share a "
                "prompt token; each group's sequences should start with the same prompt"
            )
        return ScoredGroups(
            groups,
            torch.tensor(scores, dtype=torch.float32).unsqueeze(1),
            group_sizes=sizes,
            zero_advantage=torch.tensor(zeroed, dtype=torch.bool),
            sampling_logprobs=logprobs_everywhere,
        )

    def close(self) -> None:
        self.client.close()

    def _group(self, scored: ScoredGroup) -> Group | None:
        """The trainer's group of one Atropos group; None (logged) when its rows share no prompt."""
        split = shared_prompt_length(scored.token_ids, scored.prompt_length)
        if split == 0:
            logger.warning(
                "skipped a group from Atropos environment %s: its sequences share no prompt token",
                scored.env_id,
            )
            return None
        completions = []
        for row, tokens in enumerate(scored.token_ids):
            mask = scored.loss_mask[row][split:]
            logprobs = scored.logprobs[row][split:] if scored.logprobs is not None else [0.0] * len(mask)
            completions.append(
                Completion(
                    token_ids=tokens[split:],
                    logprobs=[value if kept else 0.0 for value, kept in zip(logprobs, mask)],
                    finish_reason="stop",
                    policy_version=self.policy_version,
                    mask=mask,
                )
            )
        prompt_ids = scored.token_ids[0][:split]
        item = PromptItem(
            prompt=self.tokenizer.decode(prompt_ids),
            prompt_ids=prompt_ids,
            columns={"env_id": scored.env_id},
        )
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        return Group(item=item, completions=completions, texts=texts)

    def _zeroed(self, scored: ScoredGroup) -> list[bool]:
        """Per sequence: whether its override sets its advantage to zero."""
        overrides = scored.overrides or [{}] * len(scored.scores)
        for override in overrides:
            for key in set(override) - HONOURED_OVERRIDES:
                self._warn_once(key, f"Atropos sequences carry the override {key!r}, which grpoflow ignores")
        return [bool(override.get("set_advantage_to_zero")) for override in overrides]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)


def shared_prompt_length(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> int:
    """Length of the longest prefix every sequence shares, at most the shortest prompt (so that
    no trained token falls inside it).

    >>> shared_prompt_length([[1, 2, 3, 4], [1, 2, 5]], [2, 2])
    2
    >>> shared_prompt_length([[1, 2, 3, 4], [1, 9, 3]], [3, 2])
    1
    """
    limit = min(prompt_lengths)
    first = sequences[0]
    for index in range(limit):
        if any(sequence[index] != first[index] for sequence in sequences[1:]):
            return index
    return limit
