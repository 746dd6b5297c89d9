"""One mixture-of-experts layer's experts, forward and backward, in the training forward's
implementations: transformers' `grouped_mm` against grpoflow's `grpoflow_grouped`
(`grpoflow.kernels.grouped_experts`), at Qwen3-30B-A3B's expert shape (hidden 2048, 128 experts,
8 per token, width 768).

    python benchmarks/moe_experts.py                    # on the GPU, bf16
    python benchmarks/moe_experts.py --tokens 6144 24576

For each token count and each of frozen experts (LoRA elsewhere: input gradients only) and
training experts (their weight gradients too), the table gives milliseconds per forward+backward,
the share of the measured bf16 product peak (`step_report.MATMUL_TFLOPS`) that is (counting the grouped products' FLOPs) and the memory the
forward keeps for the backward. Routing is random with the router's softmax weights, so every
expert gets about T k / E rows. Results go to benchmarks/results/ as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from batch_invariance import timed
from step_report import matmul_tflops

from grpoflow.kernels import grouped_experts
from grpoflow.policy.loading import GROUPED_EXPERTS

RESULTS = Path(__file__).parent / "results"
CUDA = torch.device("cuda")
IMPLEMENTATIONS = ("grouped_mm", GROUPED_EXPERTS)


def experts_module(
    implementation: str, hidden: int, width: int, num_experts: int, top_k: int
) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=width, num_experts=num_experts, num_experts_per_tok=top_k
    )
    grouped_experts.register(GROUPED_EXPERTS)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config).to(CUDA, torch.bfloat16)
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    return module


def measure(module, tokens: int, train_experts: bool, repeats: int) -> dict:
    num_experts, top_k = module.gate_up_proj.shape[0], module.config.num_experts_per_tok
    module.requires_grad_(train_experts)
    x = torch.randn(
        tokens, module.gate_up_proj.shape[-1], device=CUDA, dtype=torch.bfloat16, requires_grad=True
    )
    logits = torch.randn(tokens, num_experts, device=CUDA, requires_grad=True)
    chosen = logits.detach().topk(top_k, dim=-1).indices
    upstream = torch.randn_like(x)

    def step():
        weights = logits.softmax(-1).gather(1, chosen).bfloat16()
        module(x, chosen, weights).backward(upstream)

    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    weights = logits.softmax(-1).gather(1, chosen).bfloat16()
    out = module(x, chosen, weights)
    kept = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.backward(upstream)
    peak = torch.cuda.max_memory_allocated() - before
    del out
    seconds = timed(step, repeats, CUDA, graph=False) / 1e3
    hidden, width = module.gate_up_proj.shape[-1], module.down_proj.shape[-1]
    flops_forward = 2 * tokens * top_k * hidden * 3 * width
    flops = flops_forward * (3 if train_experts else 2)
    return {
        "tokens": tokens,
        "experts_train": train_experts,
        "ms": seconds * 1e3,
        "mfu": flops / seconds / (matmul_tflops(torch.cuda.get_device_name()) * 1e12),
        "kept_gib": kept / 2**30,
        "peak_gib": peak / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[6144, 24576])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    rows = []
    for implementation in IMPLEMENTATIONS:
        module = experts_module(implementation, args.hidden, args.width, args.experts, args.top_k)
        for tokens in args.tokens:
            for train_experts in (False, True):
                row = {
                    "implementation": implementation,
                    **measure(module, tokens, train_experts, args.repeats),
                }
                rows.append(row)
                module.zero_grad(set_to_none=True)
        del module
        torch.cuda.empty_cache()
    print(
        f"{'implementation':<18} {'tokens':>7} {'experts':>8} {'ms':>8} {'mfu':>6} {'kept GiB':>9} {'peak GiB':>9}"
    )
    for row in rows:
        print(
            f"{row['implementation']:<18} {row['tokens']:>7} {'train' if row['experts_train'] else 'frozen':>8} "
            f"{row['ms']:>8.2f} {row['mfu']:>6.1%} {row['kept_gib']:>9.2f} {row['peak_gib']:>9.2f}"
        )
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    path = RESULTS / f"{datetime.date.today()}-moe-experts-{gpu}.json"
    RESULTS.mkdir(exist_ok=True)
    path.write_text(
        json.dumps({"gpu": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, indent=1)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
