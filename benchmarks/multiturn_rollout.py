"""Multi-turn rollouts on the native engine with its prefix cache and without it, in one run.

    python benchmarks/multiturn_rollout.py                      # Qwen2-0.5B-shaped, bf16, on CUDA
    python benchmarks/multiturn_rollout.py --device cpu --preset tiny --prompts 4 --samples 2

The workload is what `grpoflow.agents` does to the engine: 64 prompts x 8 samples = 512 episodes
of 4 policy turns. Each turn is one `generate` call whose prompts are every episode's whole
history (prompt, earlier turns, environment outputs); a policy turn is 64 sampled tokens
(temperature 1, a seed per episode and turn, EOS ignored), and between turns each episode gets 50
environment tokens appended as ids. Prompts are 128 random tokens. The same episodes are played
twice: with prefix caching (turn k reads turns 1..k-1 from the cache) and re-prefilling every
turn (`enable_prefix_caching=False`). Each engine is warmed up first (graphs, kernels) and its
cache emptied before the timed episodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from gpu_clock import synchronize

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.policy.tiny import build_preset_model

TOKENIZER_SIZE = 512  # the vocabulary of presets that do not set one (tiny)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Prompts, environment outputs (per episode, per turn between policy turns) and turn sizes."""

    prompts: list[list[int]]
    environment: list[list[list[int]]]
    samples: int
    turn_tokens: int
    seed: int

    @property
    def num_episodes(self) -> int:
        return len(self.prompts) * self.samples

    def params(self, turn: int) -> list[SamplingParams]:
        """One SamplingParams per episode: its own seed for each turn, so the two runs sample alike."""
        return [
            SamplingParams(
                max_tokens=self.turn_tokens,
                temperature=1.0,
                ignore_eos=True,
                seed=self.seed + episode * 1_000 + turn,
            )
            for episode in range(self.num_episodes)
        ]


def build_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(2, vocab_size, args.prompt_tokens).tolist() for _ in range(args.prompts)]
    episodes = args.prompts * args.samples
    environment = [
        [rng.integers(2, vocab_size, args.env_tokens).tolist() for _ in range(args.turns - 1)]
        for _ in range(episodes)
    ]
    return Workload(prompts, environment, args.samples, args.turn_tokens, args.seed)


def play(engine: NativeEngine, workload: Workload, num_turns: int, device: torch.device) -> dict:
    """Every episode to its end; per turn: wall time, generated, prefilled and cached tokens."""
    histories = [list(prompt) for prompt in workload.prompts for _ in range(workload.samples)]
    completions: list[list[int]] = [[] for _ in histories]
    turns = []
    for turn in range(num_turns):
        synchronize(device)
        start = time.perf_counter()
        outputs = engine.generate(histories, workload.params(turn))
        synchronize(device)
        seconds = time.perf_counter() - start
        prefill = engine.stats.prefill
        generated = 0
        for episode, (completion,) in enumerate(outputs):
            ids = completion.token_ids
            generated += len(ids)
            completions[episode] += ids
            histories[episode] += ids
            if turn < num_turns - 1:
                histories[episode] += workload.environment[episode][turn]
        turns.append(
            dict(
                turn=turn + 1,
                seconds=seconds,
                generated_tokens=generated,
                prompt_tokens=prefill.num_prefill_tokens + prefill.num_cached_tokens,
                prefill_tokens=prefill.num_prefill_tokens,
                prefix_cache_hit_tokens=prefill.num_cached_tokens,
            )
        )
    seconds = sum(turn["seconds"] for turn in turns)
    generated = sum(turn["generated_tokens"] for turn in turns)
    return dict(
        seconds=seconds,
        generated_tokens=generated,
        tokens_per_s=generated / seconds,
        prefill_tokens=sum(turn["prefill_tokens"] for turn in turns),
        prefix_cache_hit_tokens=sum(turn["prefix_cache_hit_tokens"] for turn in turns),
        turns=turns,
        completions=completions,
    )


def run_mode(
    model, workload: Workload, args: argparse.Namespace, caching: bool, device: torch.device
) -> dict:
    """One engine, warmed up on a short slice of the workload, then the timed episodes."""
    config = NativeEngineConfig(
        max_num_seqs=workload.num_episodes,
        max_model_len=args.prompt_tokens + args.turns * (args.turn_tokens + args.env_tokens),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=caching,
    )
    engine = NativeEngine(model, config=config)
    warm_up = dataclasses.replace(workload, turn_tokens=min(8, workload.turn_tokens))
    play(engine, warm_up, min(2, args.turns), device)
    engine.reset_prefix_cache()
    result = play(engine, workload, args.turns, device)
    engine.sleep()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="qwen2-0.5b", help="model shape: qwen2-0.5b or tiny")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8, help="episodes per prompt")
    parser.add_argument("--turns", type=int, default=4, help="policy turns per episode")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--turn-tokens", type=int, default=64, help="sampled tokens per policy turn")
    parser.add_argument("--env-tokens", type=int, default=50, help="environment tokens between turns")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = {} if args.layers is None else {"num_hidden_layers": args.layers}
    model = build_preset_model(args.preset, TOKENIZER_SIZE, dtype=dtype, device=device, **shape).eval()
    workload = build_workload(args, model.config.vocab_size)
    cached = run_mode(model, workload, args, True, device)
    plain = run_mode(model, workload, args, False, device)
    matching = sum(a == b for a, b in zip(cached.pop("completions"), plain.pop("completions")))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = dict(
        date=datetime.date.today().isoformat(),
        device=name,
        torch=torch.__version__,
        model=f"random {args.preset} shape, {model.config.num_hidden_layers} layers, {str(dtype).removeprefix('torch.')}",
        workload=dict(
            prompts=args.prompts,
            samples=args.samples,
            episodes=workload.num_episodes,
            turns=args.turns,
            prompt_tokens=args.prompt_tokens,
            turn_tokens=args.turn_tokens,
            env_tokens=args.env_tokens,
        ),
        prefix_caching=cached,
        no_prefix_caching=plain,
        prefill_tokens_saved=plain["prefill_tokens"] - cached["prefill_tokens"],
        speedup=plain["seconds"] / cached["seconds"],
        matching_episodes=matching / workload.num_episodes,
    )
    print_report(report)
    file_name = f"{report['date']}-multiturn-rollout-{name.replace(' ', '_')}.json"
    paths = [Path(args.output) if args.output else Path(__file__).parent / "results" / file_name]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / file_name)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def print_report(report: dict) -> None:
    """Per-turn wall time, then the totals table (last, so that it ends the output)."""
    workload = report["workload"]
    print(
        f"\n{report['device']}, {report['model']}; {workload['episodes']} episodes "
        f"({workload['prompts']} prompts x {workload['samples']}), {workload['turns']} turns of "
        f"{workload['turn_tokens']} tokens, {workload['env_tokens']} environment tokens between turns, "
        f"prompts of {workload['prompt_tokens']}"
    )
    modes = (("prefix cache", report["prefix_caching"]), ("re-prefill", report["no_prefix_caching"]))
    print(f"{'turn':<6}" + "".join(f"{label + ' s':>18}{'prefilled':>11}{'cached':>9}" for label, _ in modes))
    for index in range(workload["turns"]):
        cells = "".join(
            f"{run['turns'][index]['seconds']:>18.3f}{run['turns'][index]['prefill_tokens']:>11,}"
            f"{run['turns'][index]['prefix_cache_hit_tokens']:>9,}"
            for _, run in modes
        )
        print(f"{index + 1:<6}{cells}")
    print(f"\n{'mode':<14}{'tokens/s':>12}{'wall s':>9}{'prefill tokens':>16}{'cache hit tokens':>18}")
    for label, run in modes:
        print(
            f"{label:<14}{run['tokens_per_s']:>12,.0f}{run['seconds']:>9.2f}{run['prefill_tokens']:>16,}"
            f"{run['prefix_cache_hit_tokens']:>18,}"
        )
    print(
        f"prefill tokens saved {report['prefill_tokens_saved']:,}; speedup {report['speedup']:.2f}x; "
        f"episodes equal in both runs {report['matching_episodes']:.0%}"
    )


if __name__ == "__main__":
    main()
