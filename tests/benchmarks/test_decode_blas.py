"""benchmarks/decode_blas.py's step floor: a decode step's products against its bound (CPU: the
products' timings given)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_blas  # noqa: E402

from grpoflow.policy.step_time import GpuSpec  # noqa: E402

SPEC = GpuSpec("test", 1e12, 100e12)  # 1 TB/s, 100 TFLOP/s


def product(rows: int, depth: int, width: int, per_step: int, engine_us: float, best_us: float) -> dict:
    us = {
        "cublas out-in": engine_us,
        "cublaslt out-in": best_us + 1,
        "cublas in-out": best_us,
        "cublaslt in-out": engine_us,
    }
    return {"shape": [rows, depth, width], "per_step": per_step, "us": us}


def test_few_rows_are_bound_by_the_weights_bytes():
    products = [product(8, 1000, 2000, 10, 50.0, 40.0), product(8, 1000, 500, 1, 20.0, 10.0)]
    floor = decode_blas.step_floor(8, products, SPEC)
    assert floor["bound"] == "bytes"
    weights = 10 * 1000 * 2000 + 1000 * 500
    assert floor["step_bound_s"] == pytest.approx(2 * weights / 1e12)
    assert floor["step_products_s"]["engine"] == pytest.approx((10 * 50 + 20) / 1e6)
    assert floor["step_products_s"]["fastest"] == pytest.approx((10 * 40 + 10) / 1e6)
    assert floor["products_bound_fraction"] == pytest.approx(floor["step_bound_s"] / 410e-6)


def test_many_rows_are_bound_by_the_products_flops():
    floor = decode_blas.step_floor(4096, [product(4096, 1000, 2000, 1, 200.0, 190.0)], SPEC)
    assert floor["bound"] == "FLOPs"
    assert floor["step_bound_s"] == pytest.approx(2 * 4096 * 1000 * 2000 / 100e12)
