"""The same multi-turn episodes trained two ways, in one run of this script: an environment class
in the training process (`environment_factory`) and an agent program on the `openai` client
(`agent_program`, served by the run's hosted policy server).

    python benchmarks/agents.py                                   # Qwen2.5-0.5B-shaped, CUDA
    python benchmarks/agents.py --preset tiny --device cpu --prompts 4 --steps 3   # a quick look
    python benchmarks/agents.py --agent-workers 4      # the programs in 4 worker processes

The policy is a random model of the preset's shape over a character tokenizer (its vocabulary is
the tokenizer's, so every sampled id is text) with a chat template in Qwen2.5's layout that
renders tools. Each episode starts from one user message and offers one tool; the policy writes
up to `--turn-tokens` tokens a turn (a sampled EOS ends it), and after each turn the same short
user message comes back, `--turns` policy turns in all. The environment answers through
`respond`; the program appends the reply and the message and asks again. Both get a reward drawn
from the episode's row (the model learns nothing here: only speed is measured).

Each mode runs `grpoflow train` for `--steps` steps and the steps after the first `--warmup` are
averaged: trained tokens per second of rollout, seconds per step and episodes per second of
rollout; and how many sequences each episode trained as (`segments`: 1 when every turn's prompt
extends the turns before, as the server builds it from the ids it sampled) and its turns dropped. Prints a table and saves JSON under
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.<eos>\n{% endif %}'
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<eos>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5's layout (system block of tools, `<|im_start|>role ... <|im_end|>` turns), spelled in
the character tokenizer, whose end-of-turn token is its `<eos>` (as Qwen2.5's is `<|im_end|>`):
the token that ends a sampled turn is the one the template writes after it."""

FOLLOW_UP = "Go on."
"""The user message after each policy turn."""


def lookup(query: str) -> str:
    """Look a word up in the dictionary.

    Args:
        query: The word to look up.
    """
    return f"{query}: a word"


TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up in the dictionary.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "The word to look up."}},
            "required": ["query"],
        },
    },
}


def settings() -> dict:
    return json.loads(os.environ.get("GRPOFLOW_AGENTS_BENCH", '{"turns": 4, "turn_tokens": 32}'))


class FollowUpEnvironment:
    """Asks the policy to go on after each turn, `turns` policy turns in all."""

    def reset(self, **row) -> None:
        self.turns, self.score = 0, float(row["score"])

    def respond(self, text: str) -> str | None:
        self.turns += 1
        return None if self.turns >= settings()["turns"] else FOLLOW_UP

    def get_reward(self) -> float:
        return self.score


async def program(client, model: str, row: dict) -> float:
    """The same episode through the openai client."""
    plan = settings()
    messages = list(row["prompt"])
    for turn in range(plan["turns"]):
        reply = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=plan["turn_tokens"], tools=[TOOL_SCHEMA]
        )
        if turn + 1 < plan["turns"]:
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": FOLLOW_UP},
            ]
    return float(row["score"])


def write_inputs(directory: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The model (random, the preset's shape) with its tokenizer and template, and the rows."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_preset_model(args.preset, len(tokenizer), vocab_size=len(tokenizer), seed=0)
    model_dir = directory / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rng = random.Random(0)
    rows = directory / "rows.jsonl"
    with rows.open("w") as file:
        for index in range(args.prompts * args.steps * 2):
            prompt = [{"role": "user", "content": f"Tell me a story about the number {index}."}]
            file.write(json.dumps({"prompt": prompt, "score": rng.random()}) + "\n")
    return model_dir, rows


def train(mode: str, model_dir: Path, rows: Path, output: Path, args: argparse.Namespace) -> list[dict]:
    """`grpoflow train` in `mode` (environment or agent_program); its steps' metrics."""
    here = Path(__file__).resolve()
    episodes = args.prompts * args.generations
    options = {
        "model": str(model_dir),
        "dataset": str(rows),
        "device": args.device,
        "torch_dtype": args.dtype,
        "num_generations": args.generations,
        "per_device_train_batch_size": min(episodes, args.micro_batch),
        "gradient_accumulation_steps": max(1, episodes // args.micro_batch),
        "gradient_checkpointing": "true",
        "max_steps": args.steps,
        "max_prompt_length": 512,
        "max_completion_length": args.turns * (args.turn_tokens + 32),
        "max_turn_tokens": args.turn_tokens,
        "temperature": 1.0,
        "learning_rate": 1e-6,
        "beta": 0.0,
        "save_strategy": "no",
        "report_to": "none",
        "html_report": "false",
        "output_dir": str(output),
        "seed": 0,
    }
    if mode == "environment":
        options |= {
            "environment_factory": f"{here}:FollowUpEnvironment",
            "tools": f"{here}:lookup",
            "max_turns": args.turns,
        }
    else:
        options |= {"agent_program": f"{here}:program", "agent_concurrency": episodes}
        if args.agent_workers is not None:
            options["agent_workers"] = args.agent_workers
    command = [sys.executable, "-m", "grpoflow", "train"]
    for key, value in options.items():
        command += [f"--{key}", str(value)]
    environment = {**os.environ, "GRPOFLOW_AGENTS_BENCH": json.dumps(vars(args))}
    log = output.with_suffix(".log")
    with log.open("w") as file:
        done = subprocess.run(command, stdout=file, stderr=subprocess.STDOUT, env=environment)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed ({done.returncode}):\n{log.read_text()[-3000:]}")
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def summarize(mode: str, steps: list[dict], args: argparse.Namespace) -> dict:
    timed = steps[args.warmup :]
    episodes = args.prompts * args.generations
    rollout = statistics.mean(step["time/rollout"] for step in timed)
    return {
        "mode": mode,
        "tokens_per_s": statistics.mean(step["tokens_per_second/rollout"] for step in timed),
        "seconds_per_step": statistics.mean(step["time/step"] for step in timed),
        "rollout_seconds_per_step": rollout,
        "episodes_per_s": episodes / rollout,
        "turns_mean": statistics.mean(step.get("episodes/turns_mean", float("nan")) for step in timed),
        "dropped_turns_mean": statistics.mean(step.get("episodes/dropped_turns_mean", 0.0) for step in timed),
        "segments_mean": statistics.mean(step.get("episodes/segments_mean", 1.0) for step in timed),
        "steps_timed": len(timed),
    }


def device_name(device: str) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({os.cpu_count()} cores)"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="qwen2-0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=32, help="sequences per backward")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--modes", default="environment,agent_program")
    parser.add_argument(
        "--agent-workers",
        type=int,
        default=None,
        help="agent_workers of the agent_program mode (default: the run's choice, 0 on the CPU)",
    )
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir, data = write_inputs(Path(scratch), args)
        for mode in args.modes.split(","):
            steps = train(mode, model_dir, data, Path(scratch) / mode, args)
            rows.append(summarize(mode, steps, args))
    figures = {"device": device_name(args.device), "args": vars(args), "rows": rows}
    if len(rows) == 2:
        figures["agent_program_over_environment"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
        figures["episodes_agent_program_over_environment"] = (
            rows[1]["episodes_per_s"] / rows[0]["episodes_per_s"]
        )
    print(
        f"{'mode':<15} {'tokens/s':>10} {'s/step':>8} {'rollout s':>10} {'episodes/s':>11} {'turns':>6} {'dropped':>8} {'segments':>9}"
    )
    for row in rows:
        print(
            f"{row['mode']:<15} {row['tokens_per_s']:>10.0f} {row['seconds_per_step']:>8.2f} "
            f"{row['rollout_seconds_per_step']:>10.2f} {row['episodes_per_s']:>11.1f} {row['turns_mean']:>6.2f} "
            f"{row['dropped_turns_mean']:>8.2f} {row['segments_mean']:>9.2f}"
        )
    if "agent_program_over_environment" in figures:
        print(
            f"agent_program / environment: tokens/s {figures['agent_program_over_environment']:.2f}, "
            f"episodes/s {figures['episodes_agent_program_over_environment']:.2f}"
        )
    today = datetime.date.today().isoformat()
    tag = "cuda" if args.device == "cuda" else "cpu"
    path = (
        Path(args.output) if args.output else Path(__file__).parent / "results" / f"{today}-agents-{tag}.json"
    )
    path.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"results in {path}")


if __name__ == "__main__":
    main()
