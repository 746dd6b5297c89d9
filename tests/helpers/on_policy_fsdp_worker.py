"""Run under torchrun with 2 processes (gloo) by tests/rollout/test_on_policy_fsdp.py: on_policy_sampling's
replay through a tiny policy sharded with FSDP2, where rank 0's engine proposes the trainer's own draws
and rank 1's a perturbed model's; then a run of the recipe at the second argument (fsdp and
on_policy_sampling). Exits non-zero on the first mismatch; ranks whose collectives do not pair up fail
on the process group's timeout (the first argument, in seconds)."""

from __future__ import annotations

import copy
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as torch_dist
from native_fixtures import perturbed  # this script's own folder, tests/helpers

from grpoflow.engines import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.policy import placement
from grpoflow.policy.batch_invariant import BatchInvariantKernels, _linear_forward
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model
from grpoflow.rollout.on_policy import OnPolicyDraws, Replay
from grpoflow.run.build import run
from grpoflow.run.config import load_config

CPU = torch.device("cpu")
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12]]


class Tokens:
    """A tokenizer of ids: a text is its ids joined."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def tiny_model() -> torch.nn.Module:
    return build_preset_model("tiny", len(build_char_tokenizer()), seed=3, dtype=torch.float32, device=CPU)


def engine(model: torch.nn.Module) -> NativeEngine:
    return NativeEngine(model, config=NativeEngineConfig(max_num_seqs=16, block_size=4, num_kv_blocks=256))


def params(seed: int = 100) -> list[SamplingParams]:
    return [
        SamplingParams(n=4, max_tokens=12, temperature=1.0, stop_token_ids=(1,), seed=seed + index)
        for index in range(len(PROMPTS))
    ]


def tokens(outputs) -> list[list[int]]:
    return [completion.token_ids for completions in outputs for completion in completions]


def everyones(value: int) -> list[int]:
    gathered = [torch.zeros(1, dtype=torch.long) for _ in range(torch_dist.get_world_size())]
    torch_dist.all_gather(gathered, torch.tensor([value]))
    return [int(part) for part in gathered]


def check_sharded_replay_agrees_on_its_rounds(whole: torch.nn.Module, rank: int) -> None:
    """Outside `full_parameters` every replay forward all-gathers: rank 0 settles in one round
    and runs padding forward passes while rank 1 replaces tokens; both come out with the
    trainer's own draws and the same rounds."""
    trainer = OnPolicyDraws(Tokens(), Replay(placement.Placement.local(whole), 5, 1.0))
    want = tokens(trainer.generate(engine(copy.deepcopy(whole)), PROMPTS, params()))
    where = placement.shard_model(copy.deepcopy(whole), CPU, world_size=torch_dist.get_world_size())
    draws = OnPolicyDraws(Tokens(), Replay(where, 5, 1.0))
    proposer = copy.deepcopy(whole) if rank == 0 else perturbed(whole, 0.2)
    got = tokens(draws.generate(engine(proposer), PROMPTS, params()))
    assert got == want, f"rank {rank}: not the trainer's draws"
    rounds, replaced = everyones(draws.counts["rounds"]), everyones(draws.counts["replaced_tokens"])
    assert replaced[0] == 0 and replaced[1] > 0, replaced
    assert rounds[0] == rounds[1] >= 2, rounds
    assert draws.counts["unchecked_tokens"] == 0


def check_gathered_replay_stays_on_its_rank(whole: torch.nn.Module, rank: int) -> None:
    """Inside `full_parameters` (a rollout from the native engine) the replay's forward passes are
    each rank's own: ranks generate different numbers of times, in different rounds."""
    want = OnPolicyDraws(Tokens(), Replay(placement.Placement.local(whole), 5, 1.0))
    where = placement.shard_model(copy.deepcopy(whole), CPU, world_size=torch_dist.get_world_size())
    draws = OnPolicyDraws(Tokens(), Replay(where, 5, 1.0))
    proposer = engine(copy.deepcopy(whole) if rank == 0 else perturbed(whole, 0.2))
    with where.full_parameters():
        for call in range(2 - rank):
            got = tokens(draws.generate(proposer, PROMPTS, params(200 + call)))
            assert got == tokens(want.generate(engine(copy.deepcopy(whole)), PROMPTS, params(200 + call)))
    rounds = everyones(draws.counts["rounds"])
    assert rounds[0] == 2 and rounds[1] >= 2, rounds  # rank 0: one round in each of two calls


def check_sharded_layers_run_on_the_batch_invariant_kernels(whole: torch.nn.Module) -> None:
    """Kernels installed before sharding (as a run installs them) still compute every linear
    layer of the sharded policy, and its rows stay batch-invariant."""
    model = copy.deepcopy(whole)
    BatchInvariantKernels.install(model)
    reference = copy.deepcopy(model)
    where = placement.shard_model(model, CPU, world_size=torch_dist.get_world_size())
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    assert linears and all(module.forward.__func__ is _linear_forward for module in linears)
    ids = torch.randint(0, 30, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batch = where.sharded_forward(lambda: model(input_ids=ids).logits)
        alone = where.sharded_forward(lambda: model(input_ids=ids[1:2]).logits)
        assert torch.equal(batch, reference(input_ids=ids).logits), "not the kernels' logits"
    assert torch.equal(batch[1:2], alone), "a row changed with the batch"


def check_a_run_trains_with_no_gap(config_path: str) -> None:
    """Every step's sampled tokens are the sharded trainer's draws on every rank (the largest gap
    over the ranks is 0), with nothing left unchecked."""
    history = run(load_config(config_path))
    assert len(history) == 2
    for step in history:
        assert step["sampling/sampling_logp_difference/max"] == 0, step
        assert step["on_policy/rounds"] >= 1 and step["on_policy/unchecked_tokens"] == 0, step


def main() -> None:
    torch_dist.init_process_group("gloo", timeout=timedelta(seconds=float(sys.argv[1])))
    rank = torch_dist.get_rank()
    whole = tiny_model().eval()
    check_sharded_replay_agrees_on_its_rounds(whole, rank)
    check_gathered_replay_stays_on_its_rank(whole, rank)
    check_sharded_layers_run_on_the_batch_invariant_kernels(whole)
    check_a_run_trains_with_no_gap(sys.argv[2])  # closes the process group
    print("on-policy fsdp worker: all checks passed", flush=True)
    # The checks' sharded modules outlive the process group the run closed; tearing them down at
    # exit once aborted a rank under load ("terminate called without an active exception").
    os._exit(0)


if __name__ == "__main__":
    main()
