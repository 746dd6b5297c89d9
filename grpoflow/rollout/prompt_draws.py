"""Which prompts a step samples, and with which seeds.

Prompt indices come from a resumable order over the dataset (`PromptSampler`), and a sampling
seed is drawn for every prompt of the global batch from the run's own generator; each rank takes
its slice of both, so neither a prompt's place in the order nor its seed depends on how many ranks
share the batch. Both generators are part of a checkpoint.
"""

from __future__ import annotations

import dataclasses

import torch

from grpoflow.data.prompts import PromptSampler
from grpoflow.distributed import DistributedContext
from grpoflow.engines import SamplingParams


class PromptDraws:
    """The prompt order and the sampling seeds of one run, on one rank.

    Args:
        num_items: prompts in the dataset.
        seed: the run's seed (order and sampling seeds).
        shuffle: shuffle the order each epoch.
        sampling: the run's SamplingParams, seeded per draw.
        distributed: this rank's place among the ranks.
        per_prompt_seeds: the engine takes one SamplingParams per prompt, so each prompt gets its
            own seed; otherwise one seed per call and rank.
    """

    def __init__(
        self,
        num_items: int,
        *,
        seed: int,
        shuffle: bool,
        sampling: SamplingParams,
        distributed: DistributedContext,
        per_prompt_seeds: bool,
    ) -> None:
        self.sampler = PromptSampler(num_items, seed=seed, shuffle=shuffle)
        self.seed_generator = torch.Generator().manual_seed(seed)
        self.sampling, self.distributed, self.per_prompt_seeds = sampling, distributed, per_prompt_seeds

    def take(self, count: int) -> tuple[list[int], list[int]]:
        """This rank's next `count` prompt indices and a sampling seed for each, both sliced out
        of the global batch's (`count * world_size`)."""
        rank, world_size = self.distributed.rank, self.distributed.world_size
        indices = self.sampler.take_shard(count, rank, world_size)
        seeds = torch.randint(0, 2**62, (count * world_size,), generator=self.seed_generator)
        return indices, seeds[rank * count : (rank + 1) * count].tolist()

    def sampling_for(self, seeds: list[int]) -> SamplingParams | list[SamplingParams]:
        """The sampling parameters of prompts drawn with `seeds`."""
        if self.per_prompt_seeds:
            return [dataclasses.replace(self.sampling, seed=seed) for seed in seeds]
        if self.distributed.world_size > 1 and seeds:
            # Without a seed every rank's engine would draw the same random numbers.
            return dataclasses.replace(self.sampling, seed=seeds[0])
        return self.sampling

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "seed_generator": self.seed_generator.get_state()}

    def load_state_dict(self, state: dict) -> bool:
        """Restore the order and, when the state holds it, the seed generator; False when it does
        not (a checkpoint from before seeds were saved)."""
        self.sampler.load_state_dict(state["sampler"])
        if "seed_generator" not in state:
            return False
        self.seed_generator.set_state(state["seed_generator"])
        return True
