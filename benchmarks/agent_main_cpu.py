"""What the training process itself spends per agent-program request, with the programs in it
(`agent_workers 0`) and in worker processes (`agent_workers N`): the CPU seconds of its engine
thread (the batcher's engine calls) and of everything else it runs (its other threads: the
programs, their clients and the hosted app with agent_workers 0; with workers, the pipes' relay),
per chat request, measured with each thread's own CPU clock over the rollouts after the first.

    python benchmarks/agent_main_cpu.py --workers 0,2 --prompts 8 --generations 4

The episodes are benchmarks/agents.py's (its `program`, `--turns` turns of `--turn-tokens`), on a
random model of `--preset`'s shape over the character tokenizer, on the CPU with one torch thread
(so the engine's work stays on its thread). Prints a table and saves JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import threading
import time
from pathlib import Path

import torch

from grpoflow.agents.config import AgentConfig
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model
from grpoflow.rollout.agent_programs import AgentPrograms

HERE = Path(__file__).resolve().parent
ENGINE_THREADS = ("grpoflow-engine", "grpoflow-hosted-engine")
"""Name prefixes of the threads that run engine calls (the hosted app's, the relay's)."""


def thread_seconds() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by name."""
    seconds = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
            seconds[f"{thread.name}#{thread.ident}"] = time.clock_gettime(clock)
        except (OSError, ProcessLookupError):
            pass
    return seconds


def split(before: dict[str, float], after: dict[str, float], process: float) -> tuple[float, float]:
    """(engine thread seconds, the rest of the process's) between two readings."""
    engine = sum(after[name] - before.get(name, 0.0) for name in after if name.startswith(ENGINE_THREADS))
    return engine, process - engine


def measure(workers: int, args: argparse.Namespace, engine, tokenizer) -> dict:
    config = AgentConfig(
        agent_program=f"{HERE / 'agents.py'}:program",
        agent_concurrency=args.prompts * args.generations,
        max_turn_tokens=args.turn_tokens,
        agent_workers=workers,
    )
    agent = AgentPrograms(config, tokenizer, model_name="bench", max_model_len=2048)
    rows = []
    try:
        for round_ in range(args.rounds + 1):
            items = [
                PromptItem(
                    prompt=[{"role": "user", "content": f"Tell me a story about the number {i}."}],
                    prompt_ids=[5, 6],
                    columns={"score": 0.5},
                )
                for i in range(args.prompts)
            ]
            params = SamplingParams(n=args.generations, max_tokens=args.turns * (args.turn_tokens + 32))
            before, started, wall = thread_seconds(), time.process_time(), time.perf_counter()
            agent(engine, items, params)
            process, wall = time.process_time() - started, time.perf_counter() - wall
            engine_s, rest_s = split(before, thread_seconds(), process)
            requests = agent.last_metrics["episodes/turns_mean"] * args.prompts * args.generations
            if round_ > 0:  # the first starts the server or the workers
                rows.append((engine_s, rest_s, requests, wall))
    finally:
        agent.close()
    requests = sum(row[2] for row in rows)
    return {
        "agent_workers": workers,
        "requests": requests,
        "engine_ms_per_request": 1000 * sum(row[0] for row in rows) / requests,
        "rest_ms_per_request": 1000 * sum(row[1] for row in rows) / requests,
        "rollout_s": sum(row[3] for row in rows) / len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--workers", default="0,2", help="agent_workers values, comma-separated")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="rollouts timed, after one untimed")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    os.environ["GRPOFLOW_AGENTS_BENCH"] = json.dumps({"turns": args.turns, "turn_tokens": args.turn_tokens})
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    from agents import CHAT_TEMPLATE

    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_preset_model(args.preset, len(tokenizer), vocab_size=len(tokenizer), seed=0).eval()
    engine = build_engine("native", model, tokenizer, EngineOptions(engine=EngineConfig(max_model_len=2048)))
    rows = [measure(int(count), args, engine, tokenizer) for count in args.workers.split(",")]
    print(
        f"{'agent_workers':>13} {'requests':>9} {'engine ms/req':>14} {'rest ms/req':>12} {'rollout s':>10}"
    )
    for row in rows:
        print(
            f"{row['agent_workers']:>13} {row['requests']:>9.0f} {row['engine_ms_per_request']:>14.2f} "
            f"{row['rest_ms_per_request']:>12.2f} {row['rollout_s']:>10.2f}"
        )
    today = datetime.date.today().isoformat()
    path = Path(args.output) if args.output else HERE / "results" / f"{today}-agent-main-cpu.json"
    path.write_text(
        json.dumps({"device": f"cpu ({os.cpu_count()} cores)", "args": vars(args), "rows": rows}, indent=2)
        + "\n"
    )
    print(f"results in {path}")


if __name__ == "__main__":
    main()
