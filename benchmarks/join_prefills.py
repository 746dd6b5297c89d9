"""Agent turns joining one running native-engine call: how many prefill steps they take and what
the engine thread spends per turn, under the engine's admission settings.

    python benchmarks/join_prefills.py                          # 128 episodes x 4 turns, CPU
    python benchmarks/join_prefills.py --wait-steps 0,8,16 --episodes 64
    python benchmarks/join_prefills.py --device cuda            # the engine thread's host work

Each episode's first turn joins the call over its first steps; when a turn's answer comes back,
its next turn (the prompt so far, the answer, a short reply) joins after a random delay of a few
engine steps, as an agent program's would. The model is a random tiny one with many layers, so
that a step's cost is mostly per-layer launches, as a small model's is on a GPU (on CUDA the
engine thread's CPU time is its host work alone: scheduling and launches). Prints, for each
setting, prefill and decode steps, the engine thread's CPU seconds per turn, and the steps a turn
waited for its prefill (mean and largest); saves JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import time
from pathlib import Path

import torch

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.policy.tiny import build_tiny_model

VOCAB_SIZE = 64
MAX_LEN = 4096


class Episodes:
    """The intake: turns that join the call, each next one some steps after the last's answer."""

    def __init__(self, episodes: int, turns: int, max_delay: int, params: SamplingParams, seed: int) -> None:
        self.random = random.Random(seed)
        self.turns, self.max_delay, self.params = turns, max_delay, params
        self.prompts = [
            [3 + self.random.randrange(VOCAB_SIZE - 3) for _ in range(40)] for _ in range(episodes)
        ]
        self.done = [0] * episodes
        self.due = {episode: episode // 16 for episode in range(episodes)}  # episode -> step it joins at
        self.sent: dict[int, int] = {}  # episode -> the step its turn joined at
        self.steps = 0
        self.answered_after: list[int] = []  # steps from joining to the answer

    @property
    def finished(self) -> bool:
        return not self.due and not self.sent

    def __call__(self):
        self.steps += 1
        ready = [episode for episode, step in self.due.items() if step <= self.steps]
        for episode in ready:
            del self.due[episode]
            self.sent[episode] = self.steps
        return [([self.prompts[episode]], [self.params], self._sink(episode)) for episode in ready]

    def _sink(self, episode: int):
        def answer(groups) -> None:
            self.answered_after.append(self.steps - self.sent.pop(episode))
            self.done[episode] += 1
            if self.done[episode] < self.turns:
                reply = [3 + self.random.randrange(VOCAB_SIZE - 3) for _ in range(6)]
                self.prompts[episode] = self.prompts[episode] + groups[0][0].token_ids + reply
                self.due[episode] = self.steps + self.random.randint(1, self.max_delay)

        return answer


def measure(model, args: argparse.Namespace, wait_steps: int) -> dict:
    config = NativeEngineConfig(
        max_num_seqs=args.rows, block_size=16, num_kv_blocks=4096, prefill_wait_steps=wait_steps
    )
    engine = NativeEngine(model, config=config)
    engine.wake_up()
    params = SamplingParams(max_tokens=args.turn_tokens, temperature=1.0, ignore_eos=True)
    episodes = Episodes(args.episodes, args.turns, args.max_delay, params, seed=0)
    # one long sequence keeps the call running between turns; it stops when the last turn is answered
    keeper = SamplingParams(max_tokens=MAX_LEN - 8, temperature=1.0, ignore_eos=True)
    started = time.thread_time()
    engine.generate([[3, 4]], [keeper], intake=episodes, abandoned=lambda: [0] * episodes.finished)
    cpu = time.thread_time() - started
    turns = len(episodes.answered_after)
    assert turns == args.episodes * args.turns, turns
    extra = engine.stats.extra
    return {
        "prefill_wait_steps": wait_steps,
        "prefill_steps": int(extra["prefill_steps"]),
        "decode_steps": int(extra["decode_steps"]),
        "cpu_ms_per_turn": 1000 * cpu / turns,
        "steps_to_answer_mean": statistics.mean(episodes.answered_after),
        "steps_to_answer_max": max(episodes.answered_after),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=8)
    parser.add_argument(
        "--max-delay", type=int, default=6, help="most steps between an answer and the next turn"
    )
    parser.add_argument("--rows", type=int, default=128, help="max_num_seqs")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--wait-steps", default="0,8,16")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = (
        build_tiny_model(
            VOCAB_SIZE, hidden_size=64, num_hidden_layers=args.layers, max_position_embeddings=MAX_LEN
        )
        .to(args.device)
        .eval()
    )
    rows = [measure(model, args, int(wait)) for wait in args.wait_steps.split(",")]
    print(
        f"{'wait':>5} {'prefills':>9} {'decodes':>8} {'cpu ms/turn':>12} {'steps to answer':>16} {'max':>5}"
    )
    for row in rows:
        print(
            f"{row['prefill_wait_steps']:>5} {row['prefill_steps']:>9} {row['decode_steps']:>8} "
            f"{row['cpu_ms_per_turn']:>12.2f} {row['steps_to_answer_mean']:>16.1f} {row['steps_to_answer_max']:>5}"
        )
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    output = Path(
        args.output or Path(__file__).parent / "results" / f"{stamp}-join-prefills-{args.device}.json"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"saved {output}")


if __name__ == "__main__":
    main()
