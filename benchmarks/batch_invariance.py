"""What batch-invariant kernels cost, and whether a model run through them decodes exactly the
logits its full forward computes.

    python benchmarks/batch_invariance.py                 # random Qwen2-0.5B shape, bf16, on the GPU
    python benchmarks/batch_invariance.py --output r.json
    python benchmarks/batch_invariance.py --smoke         # a tiny model on the CPU (Triton's interpreter)

Three parts, written to one JSON (benchmarks/results/ by default) and printed as tables:

- kernels: `grpoflow.kernels.batch_invariant` / `batch_invariant_attention` against cuBLAS
  (`F.linear`), transformers' RMSNorm, torch's log-softmax and SDPA, in GPU ms (calls replayed
  from a CUDA graph) and the host's microseconds to launch a call, at the engine's decode
  shapes (`--decode-rows` rows, Qwen2-0.5B's q/k/v/o/gate_up/down/lm_head) and the trainer's
  (`--trainer-batch` x `--trainer-length` rows);
- identity: the model with its linear layers, RMSNorms and attention swapped for the kernels
  (`batch_invariant_model.use_kernels`), its full forward over left-padded sequences against a
  token-by-token decode of the same sequences with a paged KV cache (32-token blocks in shuffled
  order) through the same kernels: how many positions have bit-identical logits, and the largest
  difference; the same comparison for the stock model (SDPA and cuBLAS against the native engine's
  decode-attention kernel and cuBLAS) for scale;
- model: forward+backward seconds of the model (decoder, then the head and log-softmax in
  chunks) at `--trainer-batch` x `--trainer-length` tokens with the kernels and stock, and one decode
  step (CUDA graph) at `--decode-rows` rows with `--decode-context` tokens of context, with and
  without.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
QWEN2_LINEARS = {
    "q": (896, 896),
    "k/v": (128, 896),
    "o": (896, 896),
    "gate_up": (9728, 896),
    "down": (896, 4864),
    "lm_head": (151936, 896),
}
SMOKE_LINEARS = {
    "q": (64, 64),
    "k/v": (32, 64),
    "gate_up": (256, 64),
    "down": (64, 128),
    "lm_head": (100, 64),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="the JSON's path (default: benchmarks/results/)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, Triton's interpreter")
    parser.add_argument("--decode-rows", type=int, default=512)
    parser.add_argument("--decode-context", type=int, default=256)
    parser.add_argument("--trainer-batch", type=int, default=64)
    parser.add_argument("--trainer-length", type=int, default=384)
    parser.add_argument("--check-sequences", type=int, default=16)
    parser.add_argument("--check-length", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if args.smoke:
        args.decode_rows, args.decode_context, args.trainer_batch, args.trainer_length = 8, 20, 2, 24
        args.check_sequences, args.check_length, args.repeats = 3, 24, 1
    return args


def timed(fn, repeats: int, device, graph: bool = True) -> float:
    """Milliseconds per call of fn, after one warm-up call: on CUDA replayed from one CUDA graph
    (the GPU's time, as in the engine's decode graphs and without the host's launches), or with
    `graph` False (a training step, which syncs) called `repeats` times and waited on."""
    import torch

    fn()
    cuda = device.type == "cuda"
    if cuda and graph:
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(repeats):
                fn()
        captured.replay()
        run = captured.replay
    else:

        def run() -> None:
            for _ in range(repeats):
                fn()

    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def host_us(fn, repeats: int, device) -> float:
    """Microseconds of the host's own work per call (launching, not waiting: fewer calls than the
    launch queue holds, timed before the device is waited on)."""
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    return elapsed / repeats * 1e6


def kernel_rows(args, device, dtype) -> list[dict]:
    """Each kernel against its stock counterpart at the decode and the trainer's row counts."""
    import torch
    import torch.nn.functional as F

    from grpoflow.kernels import batch_invariant as bi
    from grpoflow.kernels import batch_invariant_attention as ba
    from grpoflow.kernels.ops import rms_norm_reference

    rows_out = []
    linears = SMOKE_LINEARS if args.smoke else QWEN2_LINEARS
    hidden = linears["q"][1]

    def add(name, rows, kernel, stock):
        kernel_ms, stock_ms = timed(kernel, args.repeats, device), timed(stock, args.repeats, device)
        rows_out.append(
            dict(
                op=name,
                rows=rows,
                kernel_ms=kernel_ms,
                stock_ms=stock_ms,
                ratio=kernel_ms / stock_ms,
                kernel_host_us=host_us(kernel, args.repeats, device),
                stock_host_us=host_us(stock, args.repeats, device),
            )
        )

    for rows in (args.decode_rows, args.trainer_batch * args.trainer_length):
        x = torch.randn(rows, max(k for _, k in linears.values()), device=device, dtype=dtype)
        for name, (n, k) in linears.items():
            if name == "lm_head" and rows > args.decode_rows:
                rows_lm = min(rows, 4096)  # the trainer projects its hidden states in chunks
                x_lm = x[:rows_lm, :k]
            else:
                rows_lm, x_lm = rows, x[:, :k]
            w = torch.randn(n, k, device=device, dtype=dtype) * k**-0.5
            add(
                f"matmul {name} ({n}x{k})",
                rows_lm,
                partial(bi.matmul_forward, x_lm, w),
                partial(F.linear, x_lm, w),
            )
        weight = torch.randn(hidden, device=device, dtype=dtype)
        xs = x[:, :hidden]
        add(
            "rms_norm",
            rows,
            partial(bi.rms_norm_forward, xs, weight, 1e-6),
            partial(rms_norm_reference, xs, weight, 1e-6),
        )
        logits = torch.randn(min(rows, 4096), linears["lm_head"][0], device=device, dtype=dtype)
        add(
            "log_softmax",
            len(logits),
            partial(bi.log_softmax_forward, logits),
            lambda t=logits: t.float().log_softmax(-1),
        )
    heads, kv_heads, dim = (4, 2, 16) if args.smoke else (14, 2, 64)
    shape = (args.trainer_batch, heads, args.trainer_length, dim)
    q = torch.randn(shape, device=device, dtype=dtype)
    k, v = torch.randn(2, args.trainer_batch, kv_heads, args.trainer_length, dim, device=device, dtype=dtype)
    positions = torch.arange(args.trainer_length, device=device)[None]
    add(
        "attention, full rows",
        args.trainer_batch * args.trainer_length,
        lambda: ba.attention_forward(q, k, v, positions, dim**-0.5),
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=dim**-0.5, enable_gqa=True),
    )
    decode_attention_row(args, device, dtype, heads, kv_heads, dim, add)
    return rows_out


def decode_attention_row(args, device, dtype, heads, kv_heads, dim, add) -> None:
    """Decode attention on the paged cache against SDPA on contiguous keys and values."""
    import torch
    import torch.nn.functional as F

    from grpoflow.kernels import batch_invariant_attention as ba

    rows, context, block_size = args.decode_rows, args.decode_context, 32
    pages = -(-context // block_size)
    table = torch.randperm(rows * pages, device=device).view(rows, pages).int()
    k_cache, v_cache = torch.randn(2, rows * pages, kv_heads, block_size, dim, device=device, dtype=dtype)
    q = torch.randn(rows, heads, dim, device=device, dtype=dtype)
    lengths = torch.full((rows,), context, device=device)
    keys, values = torch.randn(2, rows, kv_heads, context, dim, device=device, dtype=dtype)
    add(
        f"decode attention (context {context})",
        rows,
        lambda: ba.decode_attention(q, k_cache, v_cache, table, lengths, dim**-0.5),
        lambda: F.scaled_dot_product_attention(q[:, :, None], keys, values, scale=dim**-0.5, enable_gqa=True),
    )


def build_model(args, device, dtype):
    import torch

    from grpoflow.policy.tiny import build_preset_model

    name, vocab = ("tiny", 100) if args.smoke else ("qwen2-0.5b", 151936)
    model = build_preset_model(name, vocab, dtype=dtype, device=device)
    with torch.no_grad():  # biases of q/k/v as a trained model has them, not zeros
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_(0, 0.5)
    return model


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported, below
    import batch_invariant_model as bim
    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter's bf16 dot is wrong
    torch.manual_seed(0)
    started = time.perf_counter()
    result = dict(
        date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        torch=torch.__version__,
        dtype=str(dtype),
        args={key: str(value) for key, value in vars(args).items()},
    )
    result["kernels"] = kernel_rows(args, device, dtype)
    model = build_model(args, device, dtype)
    result["identity"] = bim.identity_check(model, args.check_sequences, args.check_length)
    result["model"] = bim.model_timings(model, args, device, timed)
    result["seconds"] = time.perf_counter() - started
    print_tables(result)
    output = (
        args.output
        or RESULTS / f"{result['date']}-batch-invariance-{result['device'].replace(' ', '_')}.json"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    print(f"wrote {output}")
    return result


def print_tables(result: dict) -> None:
    print(f"\n{result['device']}, {result['dtype']}")
    print(f"{'op':<34}{'rows':>8}{'kernel ms':>11}{'stock ms':>10}{'ratio':>9}{'host us':>9}{'stock':>7}")
    for row in result["kernels"]:
        print(
            f"{row['op']:<34}{row['rows']:>8}{row['kernel_ms']:>11.3f}{row['stock_ms']:>10.3f}"
            f"{row['ratio']:>9.2f}{row['kernel_host_us']:>9.1f}{row['stock_host_us']:>7.1f}"
        )
    print(f"\n{'full forward vs paged decode':<40}{'positions':>10}{'identical':>10}{'max |diff|':>12}")
    for name, row in result["identity"].items():
        print(f"{name:<40}{row['positions']:>10}{row['identical']:>10}{row['max_abs_diff']:>12.3g}")
    print(f"\n{'model':<34}{'kernels ms':>11}{'stock ms':>10}{'ratio':>7}")
    for name, row in result["model"].items():
        print(
            f"{name:<34}{row['kernel_ms']:>11.2f}{row['stock_ms']:>10.2f}{row['kernel_ms'] / row['stock_ms']:>7.2f}"
        )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
