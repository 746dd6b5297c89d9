"""Expert parallelism against FSDP2 alone: forward and backward time and peak memory of a
mixture-of-experts policy's training pass, the same global batch split over all ranks.

    torchrun --nproc_per_node 4 benchmarks/expert_parallel.py          # Qwen3-30B-A3B, 8 layers, bf16
    torchrun --nproc_per_node 2 benchmarks/expert_parallel.py --rows 4 --seq 2048
    torchrun --nproc_per_node 2 benchmarks/expert_parallel.py --smoke  # tiny model, CPU ranks (gloo)

The model is a random Qwen3-30B-A3B shape cut to 8 layers (`qwen3-30b-a3b-8l`: hidden 2048, 128
experts of intermediate size 768, 8 per token, vocabulary 151936), built in bfloat16 on every rank
with the same seed. Each rank scores its `--rows` sequences of `--seq` random tokens (the last
`--keep` of each) with the trainer's `sequence_logprobs` and runs the backward pass of their sum.

- fsdp: grpoflow's placement (`shard_model`): one FSDP2 unit per decoder layer and a root, the
  experts' fused weights sharded on their expert dimension and gathered whole for each layer.
- ep: each rank keeps 1/N of every layer's experts (`grpoflow.policy.expert_parallel`), tokens
  travel to them by all-to-all; the other parameters are sharded by FSDP2 as above, with the
  experts left out of its units (their gradients are complete on their rank).

Each mode runs `--warmup` untimed then `--steps` timed passes; the table gives the median pass
time, tokens per second over all ranks, and the largest peak memory of any rank. Both modes
build the same weights and inputs, so their losses and gradient norms agree (to bfloat16 rounding
on a GPU). Results
go to benchmarks/results/<date>-expert-parallel-<N>x<GPU>.json (and $OUT when set).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist
from gpu_clock import synchronize as wait_for
from report_file import write_report

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from grpoflow.algo import sequence_logprobs  # noqa: E402
from grpoflow.policy import placement  # noqa: E402
from grpoflow.policy.expert_parallel import expert_parameters, shard_experts  # noqa: E402
from grpoflow.policy.tiny import build_preset_model  # noqa: E402

MODES = ("fsdp", "ep")


def build(preset: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The preset's random model on `device` (the same weights on every rank)."""
    model = build_preset_model(preset, 512, seed=0, dtype=dtype, device=device)
    model.config.use_cache = False
    return model.train()


def place(model: torch.nn.Module, mode: str, device: torch.device, world_size: int) -> placement.Placement:
    """`model` laid out over the ranks as `mode` says (see the module doc)."""
    if mode == "fsdp":
        return placement.shard_model(model, device, world_size=world_size)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shard_experts(model, torch_dist.group.WORLD)
    ignored = set(expert_parameters(model))
    mesh = init_device_mesh(device.type, (world_size,))
    precision = placement.mixed_precision("auto", next(model.parameters()).dtype, device)
    options = {"mesh": mesh, "mp_policy": precision, "ignored_params": ignored}
    for layer in placement.decoder_layers(model):
        fully_shard(layer, **options)
    root = placement.ShardedRoot(model)
    fully_shard(root, reshard_after_forward=False, **options)
    for unit in [module for module in root.modules() if hasattr(module, "set_gradient_divide_factor")]:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    with torch.no_grad():
        root(lambda: None)
    root.reshard()
    return placement.Placement(module=model, device=device, root=root, mesh=mesh)


def one_pass(where: placement.Placement, ids: torch.Tensor, keep: int) -> tuple[float, float]:
    """Forward and backward of the rows' summed log-probabilities: the loss summed over ranks and
    the norm of the whole gradient (every rank's shards of it)."""
    model = where.module
    logps = where.sharded_forward(lambda: sequence_logprobs(model, ids, None, logits_to_keep=keep)[0])
    loss = logps.sum()
    loss.backward()
    squares = sum(
        local(parameter.grad).double().square().sum()
        for parameter in model.parameters()
        if parameter.grad is not None
    )
    model.zero_grad(set_to_none=True)
    totals = torch.stack([loss.detach().double(), squares])
    torch_dist.all_reduce(totals)
    return float(totals[0]), float(totals[1].sqrt())


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP's), else the tensor itself (an expert-parallel share)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def measure(args, mode: str, device: torch.device, dtype: torch.dtype) -> dict:
    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    model = build(args.preset, device, dtype)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    where = place(model, mode, device, world_size)
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(3, model.config.vocab_size, (args.rows * world_size, args.seq), generator=generator)
    ids = batch.chunk(world_size)[rank].to(device)
    times, results = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        start = time.perf_counter()
        results.append(one_pass(where, ids, args.keep))
        synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = None  # not measured on the CPU
    if device.type == "cuda":
        peak = max_over_ranks(torch.cuda.max_memory_allocated(device) / 2**30, device)
    seconds = max_over_ranks(statistics.median(times), device)
    del where, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tokens = args.rows * world_size * args.seq
    return dict(
        mode=mode,
        ranks=world_size,
        seconds=seconds,
        tokens_per_s=tokens / seconds,
        peak_gib=peak,
        loss=results[-1][0],
        grad_norm=results[-1][1],
        tokens=tokens,
    )


def synchronize(device: torch.device) -> None:
    wait_for(device)
    torch_dist.barrier()


def max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return float(tensor)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny model on CPU ranks (gloo)")
    parser.add_argument("--preset", default=None, help="model preset (default qwen3-30b-a3b-8l)")
    parser.add_argument("--rows", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--keep", type=int, default=512, help="scored tokens at the end of each sequence")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset = args.preset or "tiny-moe"
        args.rows, args.seq, args.keep, args.warmup, args.steps = 2, 16, 8, 1, 2
    args.preset = args.preset or "qwen3-30b-a3b-8l"
    cuda = torch.cuda.is_available() and not args.smoke
    torch_dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = [measure(args, mode, device, dtype) for mode in MODES]
    world_size = torch_dist.get_world_size()
    report = dict(
        date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        ranks=world_size,
        torch=torch.__version__,
        model=f"random {args.preset}, {str(dtype).removeprefix('torch.')}",
        workload=dict(rows_per_rank=args.rows, seq=args.seq, keep=args.keep, steps=args.steps),
        gradient_checkpointing=args.gradient_checkpointing,
        rows=rows,
    )
    if torch_dist.get_rank() == 0:
        write(report, args.output)
        print_table(report)
    torch_dist.destroy_process_group()
    return report


def write(report: dict, output: str | None) -> None:
    """To `output`, else benchmarks/results/<date>-expert-parallel-<N>x<device>.json (and $OUT)."""
    write_report(
        report,
        f"{report['date']}-expert-parallel-{report['ranks']}x{report['device'].replace(' ', '_')}.json",
        output,
    )


def print_table(report: dict) -> None:
    print(f"\n{report['ranks']} x {report['device']}, {report['model']}, {report['workload']}")
    print(f"{'mode':<6}{'ms/pass':>10}{'tokens/s':>12}{'peak GiB':>10}{'loss':>16}{'grad norm':>14}")
    for row in report["rows"]:
        print(
            f"{row['mode']:<6}{1000 * row['seconds']:>10.1f}{row['tokens_per_s']:>12,.0f}"
            f"{row['peak_gib'] if row['peak_gib'] is None else round(row['peak_gib'], 2)!s:>10}{row['loss']:>16.6g}{row['grad_norm']:>14.6g}"
        )


if __name__ == "__main__":
    main()
