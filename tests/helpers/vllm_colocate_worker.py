"""Run under torchrun by tests/engines/test_colocate.py: builds a colocated-vLLM run from the
config file given as argument, probes each rank's engine before and after training, and prints
every rank's observations (with the metrics of each step) as one JSON line (`RESULT [...]`) on
rank 0."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as torch_dist

from grpoflow.algo import sequence_logprobs
from grpoflow.engines import SamplingParams
from grpoflow.run.build import build_trainer
from grpoflow.run.config import load_config

PROMPTS = [[5, 6, 7, 8], [20, 21], [30, 31, 32]]


def greedy(engine) -> list:
    params = SamplingParams(n=1, max_tokens=6, temperature=0.0)
    return [group[0] for group in engine.generate(PROMPTS, params)]


def trainer_gap(model: torch.nn.Module, completions: list) -> float:
    """Largest gap between the engine's log-probs of its greedy completions and the trainer's."""
    model.eval()
    gaps = []
    with torch.no_grad():
        for prompt, completion in zip(PROMPTS, completions):
            ids = torch.tensor([prompt + completion.token_ids])
            want, _ = sequence_logprobs(
                model, ids, torch.ones_like(ids), logits_to_keep=len(completion.token_ids)
            )
            gaps.append((want[0] - torch.tensor(completion.logprobs)).abs().max().item())
    return max(gaps)


def main() -> None:
    trainer = build_trainer(load_config(sys.argv[1]))
    engine, rank = trainer.engine, trainer.distributed.rank
    prompt_counts: list[int] = []
    generate = engine.generate

    def counting_generate(prompts, params):
        prompt_counts.append(len(prompts))
        return generate(prompts, params)

    engine.generate = counting_generate
    before = greedy(engine)
    unseeded = engine.generate([PROMPTS[0]], SamplingParams(n=4, max_tokens=8, temperature=1.0))[0]
    history = trainer.train()
    after = greedy(engine)
    observed = {
        "rank": rank,
        "engine_index": engine.layout.engine_index,
        "num_engines": engine.layout.num_engines,
        "history": history,
        "policy_version": engine.policy_version,
        "changed": [c.logprobs for c in after] != [c.logprobs for c in before],
        "trainer_gap": trainer_gap(trainer.model, after),
        "unseeded": [c.token_ids for c in unseeded],
        "prompt_counts": prompt_counts,
    }
    gathered = [None] * trainer.distributed.world_size
    torch_dist.all_gather_object(gathered, observed)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    trainer.close()
    engine.close()
    trainer.distributed.close()


if __name__ == "__main__":
    main()
