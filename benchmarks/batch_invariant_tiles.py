"""Tile configurations of the batch-invariant matmul: their speed at the trainer's and the engine's
shapes, and whether each computes the bits the shipped configuration (`MATMUL_TILE`) computes.

    python benchmarks/batch_invariant_tiles.py            # Qwen2-0.5B's products, bf16, on the GPU

A configuration whose outputs equal `MATMUL_TILE`'s bit for bit at every shape could serve some
row counts while the shipped one serves the others, and the engine's logits would still be the
trainer's; one that differs anywhere could only replace it everywhere. For each configuration the
table gives milliseconds per shape beside cuBLAS (`F.linear`) and `identical` (all shapes equal to
the shipped configuration's). Results go to benchmarks/results/ as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from batch_invariance import timed

from grpoflow.kernels.batch_invariant import (
    LARGE_TILE,
    MATMUL_TILE,
    SMALL_TILE,
    MatmulTile,
    matmul_forward,
)

RESULTS = Path(__file__).parent / "results"
CUDA = torch.device("cuda")
SHAPES = (  # (name, rows, out features, in features)
    ("qkv train", 12288, 1152, 896),
    ("o train", 12288, 896, 896),
    ("gate_up train", 12288, 9728, 896),
    ("down train", 12288, 896, 4864),
    ("head train", 4096, 151936, 896),
    ("qkv decode", 512, 1152, 896),
    ("o decode", 512, 896, 896),
    ("gate_up decode", 512, 9728, 896),
    ("down decode", 512, 896, 4864),
    ("head decode", 512, 151936, 896),
)
TILES = (  # block m, n, k, group m, warps, stages
    MATMUL_TILE,
    LARGE_TILE,
    SMALL_TILE,
    MatmulTile(64, 128, 64, 8, 4, 4),
    MatmulTile(128, 64, 64, 8, 4, 4),
    MatmulTile(64, 64, 128, 8, 4, 3),
    MatmulTile(64, 32, 64, 8, 4, 4),
    MatmulTile(32, 64, 64, 8, 4, 4),
    MatmulTile(32, 32, 64, 8, 2, 4),
    MatmulTile(16, 64, 64, 8, 4, 4),
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    inputs = {
        name: (
            torch.randn(rows, k, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5,
        )
        for name, rows, n, k in SHAPES
    }
    reference = {name: matmul_forward(x, w, tile=MATMUL_TILE) for name, (x, w) in inputs.items()}
    stock = {
        name: timed(lambda x=x, w=w: F.linear(x, w), args.repeats, CUDA) for name, (x, w) in inputs.items()
    }
    rows = []
    for tile in TILES:
        times, same = {}, True
        for name, (x, w) in inputs.items():
            try:
                out = matmul_forward(x, w, tile=tile)
            except Exception as error:  # a tile too large for the GPU's shared memory
                times[name], same = f"{type(error).__name__}", False
                continue
            same &= torch.equal(out, reference[name])
            times[name] = timed(lambda x=x, w=w, t=tile: matmul_forward(x, w, tile=t), args.repeats, CUDA)
        rows.append({"tile": tile.__dict__, "identical": bool(same), "ms": times})
    print("tile (m,n,k,group,warps,stages) | identical | " + " | ".join(name for name, *_ in SHAPES))
    print("cuBLAS | - | " + " | ".join(f"{stock[name]:.3f}" for name, *_ in SHAPES))
    for row in rows:
        t = row["tile"]
        label = (
            f"{t['block_m']},{t['block_n']},{t['block_k']},{t['group_m']},{t['num_warps']},{t['num_stages']}"
        )
        cells = [f"{v:.3f}" if isinstance(v, float) else v for v in row["ms"].values()]
        print(f"{label} | {row['identical']} | " + " | ".join(cells))
    device = torch.cuda.get_device_name()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{datetime.date.today()}-batch-invariant-tiles-{device.replace(' ', '_')}.json"
    path.write_text(json.dumps({"device": device, "stock_ms": stock, "rows": rows}, indent=2))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
