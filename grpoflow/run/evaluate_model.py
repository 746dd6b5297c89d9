"""`grpoflow eval`: evaluate a model or a run's checkpoint on a dataset with rewards, with no
training set-up (no optimizer, no reference model, no output-directory claim).

The data, reward, agent and engine options are the training run's; the prompts are
`eval_dataset` (or `dataset`) in `eval_split`, each sampled `num_generations_eval` times. A
checkpoint directory is taken as the model: a full one as it is, an adapter merged into the base
model of the run that wrote it. Results go to `output_dir/eval_results.json` (the metrics and
settings) and `output_dir/eval_completions.jsonl` (every completion with its rewards).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from grpoflow.agents.setup import agent_environment
from grpoflow.distributed import DistributedContext
from grpoflow.policy import adapter_checkpoints
from grpoflow.policy.loading import resolve_device
from grpoflow.rewards import RewardRunner
from grpoflow.run import checkpoint
from grpoflow.run.build import build_rollout_engine, quiet_request_logs, run_cleanups, seed_everything
from grpoflow.run.config import GRPOConfig
from grpoflow.run.evaluation import Evaluator
from grpoflow.run.export import adapter_base
from grpoflow.run.sources import build_rollout, rollout_rewards
from grpoflow.run.step_metrics import completion_rows

logger = logging.getLogger("grpoflow")

RESULTS_FILE = "eval_results.json"
COMPLETIONS_FILE = "eval_completions.jsonl"


def evaluate_model(config: GRPOConfig) -> dict[str, float]:
    """Evaluate `config.policy.model` on the eval prompts; the `eval/...` metrics, also written
    with every completion into `config.training.output_dir`."""
    started = time.perf_counter()
    config.agent.check_installed()
    quiet_request_logs()
    seed_everything(config.training.seed)
    device = resolve_device(config.policy.device)
    factory = agent_environment(config.agent)
    rewards = RewardRunner.from_config(config.rewards, device=device, extra=rollout_rewards(config, factory))
    tokenizer = config.policy.load_tokenizer()
    data = dataclasses.replace(
        config.data,
        dataset=config.eval.eval_dataset or config.data.dataset,
        dataset_split=config.eval.eval_split,
    )
    items = data.load_prompts(tokenizer, seed=config.training.seed)
    per_prompt_seeds = config.generation.engine_name == "native"
    rollout = build_rollout(config, tokenizer, factory)
    model = load_policy(config, len(tokenizer), device).eval().requires_grad_(False)
    engine = build_rollout_engine(config, model, tokenizer, DistributedContext(), None)
    eos = tokenizer.eos_token_id
    sampling = dataclasses.replace(
        config.generation.sampling,
        n=config.generation.num_generations,
        stop_token_ids=[eos] if eos is not None else [],
    )
    evaluator = Evaluator(
        config.eval,
        items,
        rollout=rollout,
        rewards=rewards,
        sampling=sampling,
        per_prompt_seeds=per_prompt_seeds,
        batch_size=config.generation_batch_size,
    )
    with rewards, torch.no_grad():
        engine.wake_up()
        result = evaluator(engine)
        engine.sleep()  # frees the KV cache now rather than when the engine is collected
    for close in (*run_cleanups(rollout, None), engine.close):  # an agent program's server, the engine
        close()
    write_results(config, result.metrics, evaluator, time.perf_counter() - started)
    rows = completion_rows(result.groups, result.rewards, torch.zeros(len(result.rewards)), rewards.names)
    output = Path(config.training.output_dir)
    with open(output / COMPLETIONS_FILE, "w", encoding="utf-8") as file:
        for row in rows:
            row.pop("advantage")
            file.write(json.dumps(row, default=str) + "\n")
    return result.metrics


def load_policy(config: GRPOConfig, vocab_size: int, device: torch.device) -> torch.nn.Module:
    """The model to evaluate: a run's adapter checkpoint merged into its base, else the model."""
    source = config.policy.model
    if (
        source is not None
        and checkpoint.is_checkpoint(source)
        and adapter_checkpoints.is_adapter_checkpoint(source)
    ):
        base = adapter_base(Path(source), None, vocab_size=vocab_size, device=device)
        return adapter_checkpoints.merge_adapter_checkpoint(base, source)
    return config.policy.build(vocab_size=vocab_size, seed=config.training.seed, device=device)


def write_results(
    config: GRPOConfig, metrics: dict[str, float], evaluator: Evaluator, seconds: float
) -> None:
    """`eval_results.json`: the metrics and what produced them."""
    output = Path(config.training.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    settings: dict[str, Any] = {
        "model": config.policy.model,
        "dataset": config.eval.eval_dataset or config.data.dataset,
        "split": config.eval.eval_split,
        "num_generations_eval": evaluator.sampling.n,
        "temperature": evaluator.sampling.temperature,
        "max_completion_length": evaluator.sampling.max_tokens,
        "pass_reward": evaluator.pass_reward,
        "pass_threshold": config.eval.eval_pass_threshold,
        "engine": config.generation.engine_name,
        "seconds": seconds,
    }
    clean = {name: value if math.isfinite(value) else None for name, value in metrics.items()}
    (output / RESULTS_FILE).write_text(json.dumps({"settings": settings, "metrics": clean}, indent=2) + "\n")


def results_table(metrics: dict[str, float]) -> str:
    """The metrics as an aligned two-column table, pass@k and maj@k first."""

    def order(name: str) -> tuple[int, int, str]:
        short = name.removeprefix("eval/")
        head, _, k = short.partition("@")
        rank = {"pass": 0, "maj": 1, "avg": 2}.get(head, 3)
        return rank, int(k) if k.isdigit() else 0, short

    rows = [
        (name.removeprefix("eval/"), value)
        for name, value in sorted(metrics.items(), key=lambda kv: order(kv[0]))
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value:>12.4f}" for name, value in rows)
