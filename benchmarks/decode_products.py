"""A decode step's products, each with the elementwise kernel before it: the native engine's
separate kernels (Triton RMSNorm or SiLU-and-multiply, then cuBLAS through `F.linear`) against
`fused_products.py`'s kernels (one kernel each), over a sweep of tiles.

    python benchmarks/decode_products.py                      # on the GPU, bf16
    python benchmarks/decode_products.py --models qwen2-0.5b --rows 512

Per model shape and row count, for each product of a layer (q/k/v after the input norm, o,
gate/up after the second norm, gate/up with SiLU-and-multiply after it too, gate/up alone, down
after SiLU-and-multiply), the table gives microseconds per
layer for the separate kernels, for the fused kernel at `product_config`'s tiles and at the best
tiles of the sweep, and the largest difference from the separate kernels' output relative to its
largest value. Every layer has weights of its own, cycled in one CUDA graph, so weights come from
memory as in a decode step. Results go to benchmarks/results/ as JSON.
"""

from __future__ import annotations

import fused_products as kernels
import torch
import torch.nn.functional as F
from batch_invariance import timed
from decode_blas import decode_arguments
from fused_products import Tiles
from report_file import save_result

from grpoflow.kernels.decoder import TritonOps

CUDA = torch.device("cuda")
SHAPES = {  # hidden, intermediate, q/k/v width, o input width, layers
    "qwen2-0.5b": (896, 4864, 896 + 2 * 128, 896, 24),
    "qwen2.5-7b": (3584, 18944, 3584 + 2 * 512, 3584, 28),
}
SWEEP = [
    Tiles(m, n, k, w, s)
    for m, n, k, w, s in [
        (64, 32, 128, 4, 4),
        (64, 64, 64, 4, 4),
        (64, 64, 128, 4, 3),
        (64, 128, 64, 4, 4),
        (64, 128, 128, 8, 3),
        (64, 256, 64, 8, 3),
        (128, 64, 64, 4, 4),
        (128, 64, 128, 8, 3),
        (128, 128, 64, 8, 4),
        (128, 128, 128, 8, 3),
        (128, 256, 64, 8, 3),
    ]
] + [Tiles(64, 64, 64, 4, 4, False), Tiles(128, 128, 64, 8, 4, False)]


def layer_weights(shape: tuple, layers: int) -> list[dict]:
    hidden, inner, qkv, o_in, _ = shape

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=CUDA, dtype=torch.bfloat16) * cols**-0.5

    return [
        {
            "qkv": weight(qkv, hidden),
            "qkv_bias": torch.randn(qkv, device=CUDA, dtype=torch.bfloat16) * 0.1,
            "o": weight(hidden, o_in),
            "gate_up": weight(2 * inner, hidden),
            "down": weight(hidden, inner),
            "norm": 1 + 0.1 * torch.randn(hidden, device=CUDA, dtype=torch.bfloat16),
        }
        for _ in range(layers)
    ]


def products(rows: int, shape: tuple) -> dict:
    """Each product's weight matrix and its (separate kernels, fused kernel at tiles) callables over
    one layer's weights."""
    hidden, inner, _, o_in, _ = shape
    x, residual = torch.randn(2, rows, hidden, device=CUDA, dtype=torch.bfloat16).unbind(0)
    attention = torch.randn(rows, o_in, device=CUDA, dtype=torch.bfloat16)
    gate_up = torch.randn(rows, 2 * inner, device=CUDA, dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    return {
        "qkv": (
            "qkv",
            lambda w: F.linear(TritonOps.rms_norm(x, w["norm"], 1e-6, residual)[0], w["qkv"], w["qkv_bias"]),
            lambda w, t: kernels.norm_product(x, w["norm"], 1e-6, residual, w["qkv"], w["qkv_bias"], t)[0],
        ),
        "o": (
            "o",
            lambda w: F.linear(attention, w["o"]),
            lambda w, t: kernels.plain_product(attention, w["o"], None, t),
        ),
        "gate_up": (
            "gate_up",
            lambda w: F.linear(TritonOps.rms_norm(x, w["norm"], 1e-6, residual)[0], w["gate_up"]),
            lambda w, t: kernels.norm_product(x, w["norm"], 1e-6, residual, w["gate_up"], None, t)[0],
        ),
        "gate_up_silu": (
            "gate_up",
            lambda w: TritonOps.silu_mul(
                *F.linear(TritonOps.rms_norm(x, w["norm"], 1e-6, residual)[0], w["gate_up"]).chunk(2, dim=-1)
            ),
            lambda w, t: kernels.norm_gated_product(x, w["norm"], 1e-6, residual, w["gate_up"], t)[0],
        ),
        "gate_up_plain": (
            "gate_up",
            lambda w: F.linear(x, w["gate_up"]),
            lambda w, t: kernels.plain_product(x, w["gate_up"], None, t),
        ),
        "down": (
            "down",
            lambda w: F.linear(TritonOps.silu_mul(gate, up), w["down"]),
            lambda w, t: kernels.gated_product(gate, up, w["down"], None, t),
        ),
    }


def per_layer_us(fn, weights: list[dict], repeats: int) -> float:
    return timed(lambda: [fn(w) for w in weights], repeats, CUDA) * 1000 / len(weights)


def measure(model: str, rows: int, repeats: int) -> list[dict]:
    shape = SHAPES[model]
    weights = layer_weights(shape, shape[-1])
    out = []
    for name, (matrix, separate, fused) in products(rows, shape).items():
        reference = separate(weights[0]).float()
        separate_us = per_layer_us(separate, weights, repeats)
        width, depth = weights[0][matrix].shape
        chosen = kernels.product_config(rows, width, depth)
        sweep = {}
        for tiles in dict.fromkeys([chosen, *SWEEP]):
            try:
                sweep[tiles] = per_layer_us(lambda w, t=tiles, run=fused: run(w, t), weights, repeats)
            except Exception as error:  # tiles that need more shared memory than the GPU has
                print(f"  {name} {tuple(tiles)}: {type(error).__name__}")
        best = min(sweep, key=sweep.get)
        error = (fused(weights[0], chosen).float() - reference).abs().max() / reference.abs().max()
        out.append(
            {
                "model": model,
                "rows": rows,
                "product": name,
                "shape": [rows, depth, width],
                "separate_us": separate_us,
                "fused_us": sweep[chosen],
                "fused_tiles": list(chosen),
                "best_us": sweep[best],
                "best_tiles": list(best),
                "sweep_us": {str(tuple(t)): v for t, v in sweep.items()},
                "relative_error": float(error),
            }
        )
        row = out[-1]
        print(
            f"{model:<11}{rows:>5} {name:<8}{row['separate_us']:>10.2f}{row['fused_us']:>10.2f}"
            f"{row['best_us']:>10.2f}  {str(tuple(best)):<24}{row['relative_error']:>9.1e}",
            flush=True,
        )
    return out


def main() -> None:
    args = decode_arguments(__doc__, SHAPES)
    header = f"{'model':<11}{'rows':>5} {'product':<8}{'separate':>10}{'fused':>10}{'best':>10}  {'best tiles':<24}{'error':>9}"
    print(header + "\n(microseconds per layer)")
    rows = [
        row for model in args.models for count in args.rows for row in measure(model, count, args.repeats)
    ]
    print("\n" + header)
    for row in rows:
        print(
            f"{row['model']:<11}{row['rows']:>5} {row['product']:<8}{row['separate_us']:>10.2f}"
            f"{row['fused_us']:>10.2f}{row['best_us']:>10.2f}  {str(tuple(row['best_tiles'])):<24}"
            f"{row['relative_error']:>9.1e}"
        )
    save_result("decode-products", args.tag, torch.cuda.get_device_name(), rows=rows)


if __name__ == "__main__":
    main()
