"""A decode step's products through cuBLAS and cuBLASLt, with the weights in either layout, and
what the products alone leave of the step's roofline.

    python benchmarks/decode_blas.py                                  # on the GPU, bf16
    python benchmarks/decode_blas.py --models qwen2-0.5b --rows 512

Per model shape and row count, for each product of a decode step (q/k/v with its bias, o, gate/up,
down, the output head), the table gives microseconds per product through each library with the
weight as the model keeps it ((out, in), `F.linear`, as the native engine runs it) and transposed
((in, out), a copy), and the bandwidth and FLOP rate of the fastest. Every layer has weights of its
own, cycled in one CUDA graph, so weights come from memory as in a decode step. The last line of
each block adds a whole step's products, as the engine runs them and at the fastest of the four,
and sets them against the step's bound, max(weight bytes / bandwidth, product FLOPs / peak) with
the rollout benchmark's figures (`step_time.KNOWN_GPUS`): no engine that runs these products can
decode faster than that share of the bound. Results go to benchmarks/results/ as JSON.

A faster library here need not be faster in a decode step: on one H200 the 7B shape's down product
at 128 rows took 41.1 us through cuBLASLt against 47.0 through cuBLAS in this table, but 46.5
against 45.3 (with its split-K reduction) inside the engine's decode graph, and the rollout did not
get faster (1.360 against 1.361 s for 16 prompts x 8).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from batch_invariance import timed
from report_file import save_result

from grpoflow.policy.step_time import GpuSpec, known_gpu

CUDA = torch.device("cuda")
SHAPES = {  # product: (out, in); layers
    "qwen2-0.5b": ({"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}, 24, 151936),
    "qwen2.5-7b": ({"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}, 28, 152064),
}  # fmt: skip
LIBRARIES = ("cublas", "cublaslt")
HEAD_COPIES = 2  # the output head is read once a step: two copies already overflow the L2 cache


def measure(model: str, rows: int, repeats: int) -> dict:
    per_layer, layers, vocab = SHAPES[model]
    hidden = per_layer["o"][0]
    products = {
        **{name: (shape, layers) for name, shape in per_layer.items()},
        "head": ((vocab, hidden), HEAD_COPIES),
    }
    out = []
    for name, ((width, depth), count) in products.items():
        weights = [
            torch.randn(width, depth, device=CUDA, dtype=torch.bfloat16) * depth**-0.5 for _ in range(count)
        ]
        bias = torch.randn(width, device=CUDA, dtype=torch.bfloat16) if name == "qkv" else None
        x = torch.randn(rows, depth, device=CUDA, dtype=torch.bfloat16)
        times = {}
        for layout in ("out-in", "in-out"):
            run = products_of(x, weights, bias, transposed=layout == "in-out")
            for library in LIBRARIES:
                with blas_library(library):
                    times[f"{library} {layout}"] = timed(run, repeats, CUDA) * 1000 / count
            del run
        fastest = min(times.values())
        moved = 2 * (width * depth + rows * (width + depth))
        row = {
            "model": model,
            "rows": rows,
            "product": name,
            "shape": [rows, depth, width],
            "us": times,
            "fastest_tb_per_s": moved / fastest / 1e6,
            "fastest_tflop_per_s": 2 * rows * width * depth / fastest / 1e6,
            "per_step": layers if name != "head" else 1,
        }
        out.append(row)
        cells = "".join(f"{us:>15.2f}" for us in times.values())
        print(
            f"{model:<11}{rows:>5} {name:<8}{cells}  {row['fastest_tb_per_s']:>6.2f}"
            f"{row['fastest_tflop_per_s']:>7.0f}",
            flush=True,
        )
        del weights
    floor = step_floor(rows, out, known_gpu(torch.cuda.get_device_name()))
    print(
        f"{model} at {rows} rows: products {1000 * floor['step_products_s']['engine']:.3f} ms a step as the "
        f"engine runs them, {1000 * floor['step_products_s']['fastest']:.3f} at the fastest of the four; "
        f"bound {1000 * floor['step_bound_s']:.3f} ms ({floor['bound']}): the products alone allow at "
        f"most {floor['products_bound_fraction']:.0%} of it",
        flush=True,
    )
    return {"products": out, **floor}


@contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's products go through `name` ("cublas" or "cublaslt") inside the block."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def products_of(x: torch.Tensor, weights: list, bias: torch.Tensor | None, transposed: bool):
    """One product of `x` by each weight, kept as `F.linear` takes it or transposed (a copy made here)."""
    if not transposed:
        return lambda: [F.linear(x, weight, bias) for weight in weights]
    stored = [weight.t().contiguous() for weight in weights]
    if bias is None:
        return lambda: [x @ weight for weight in stored]
    return lambda: [torch.addmm(bias, x, weight) for weight in stored]


def step_floor(rows: int, products: list[dict], spec: GpuSpec | None) -> dict:
    """The products of one decode step of `rows` rows as the engine runs them (cuBLAS, weights as
    kept) and at their fastest, against the step's bound on `spec`'s GPU."""
    fastest = sum(min(p["us"].values()) * p["per_step"] for p in products) / 1e6
    engine = sum(p["us"]["cublas out-in"] * p["per_step"] for p in products) / 1e6
    parameters = sum(p["shape"][1] * p["shape"][2] * p["per_step"] for p in products)
    bytes_bound = 2 * parameters / spec.bandwidth if spec else float("nan")
    flops_bound = 2 * parameters * rows / spec.bf16_flops if spec else float("nan")
    bound = max(bytes_bound, flops_bound)
    return {
        "step_products_s": {"engine": engine, "fastest": fastest},
        "step_bound_s": bound,
        "bound": "FLOPs" if flops_bound > bytes_bound else "bytes",
        "products_bound_fraction": bound / fastest,
    }


def decode_arguments(doc: str, shapes: dict) -> argparse.Namespace:
    """The decode benchmarks' command line: model shapes, row counts, repeats and a tag for the
    results' name."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(shapes), choices=list(shapes))
    parser.add_argument("--rows", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tag", default="")
    return parser.parse_args()


def main() -> None:
    args = decode_arguments(__doc__, SHAPES)
    header = "".join(f"{f'{lib} {layout}':>15}" for layout in ("out-in", "in-out") for lib in LIBRARIES)
    print(f"{'model':<11}{'rows':>5} {'product':<8}{header}  {'TB/s':>6}{'TF/s':>7}   (us per product)")
    blocks = [measure(model, rows, args.repeats) for model in args.models for rows in args.rows]
    save_result("decode-blas", args.tag, torch.cuda.get_device_name(), blocks=blocks)


if __name__ == "__main__":
    main()
