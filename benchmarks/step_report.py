"""What benchmarks/grpo_step.py reports of each system's steps: the parameters a token passes
through, the steady steps' means per phase, throughput and MFU, and the table it prints."""

from __future__ import annotations

import torch

MATMUL_TFLOPS = {"H100": 787.0, "H200": 790.0}
COMPLETIONS, GROUP_SIZE, PROMPT_TOKENS = 512, 8, 128
"""The workloads' shape (grpo_step.py; scaling.py per GPU): completions a step, completions per
prompt and prompt tokens."""


def update_tokens(completions: int, generated: float, shared: bool) -> tuple[float, float]:
    """(trained, executed) tokens of an update over `completions` completions of `generated` new
    tokens on average, each after a PROMPT_TOKENS-token prompt: each prompt counted once per
    completion, and executed once per group of GROUP_SIZE where the prompts are `shared`."""
    trained = completions * (PROMPT_TOKENS + generated)
    executed = completions // GROUP_SIZE * PROMPT_TOKENS + completions * generated if shared else trained
    return trained, executed


def matmul_tflops(gpu: str) -> float | None:
    """The measured bf16 matrix-product peak of the GPU named `gpu` (MATMUL_TFLOPS), else None."""
    return next((value for key, value in MATMUL_TFLOPS.items() if key in gpu), None)


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters a token multiplies by: all of a dense model's but an input embedding that is not
    also the output head (a lookup); of a mixture-of-experts model's expert weights, only the
    routed experts' share (num_experts_per_tok of num_experts)."""
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = 0 if embedding is head else -embedding.numel()
    for name, parameter in model.named_parameters():
        share = config.num_experts_per_tok / experts if experts and ".experts." in name else 1.0
        total += int(parameter.numel() * share)
    return total


def flops_per_token_parameter(settings: list[str]) -> int:
    """Model FLOPs of the update per token and active parameter: 2 forward, 2 for the input
    gradients and 2 for the weight gradients, the last 2 not for a LoRA policy's frozen base
    (its adapters' few are left out); recomputes under checkpointing are not counted."""
    lora = any(setting.replace(" ", "") in ("train_type=lora", "train_type=qlora") for setting in settings)
    return 4 if lora else 6


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def summarize(
    name: str, result: dict, warmup: int, num_params: int, tflops: float | None, flops_per_token: int = 6
) -> dict:
    """The row of one system's steps; `update_mfu` counts `flops_per_token` (per active
    parameter, `flops_per_token_parameter`) for every trained token, `update_executed_mfu` for the
    tokens the update ran (under shared prompts, each group's prompt once)."""
    steady = result["steps"][warmup:]
    if not steady:  # cut off by --time-limit within the warmup: say the means include it
        steady = result["steps"]

    def mean(key: str) -> float | None:
        values = [step[key] for step in steady if step.get(key) is not None]
        return sum(values) / len(values) if values else None

    row = {"system": name, "seconds_per_step": mean("time/wall"), "peak_gib": result["peak_gib"]}
    row["timed_steps"] = len(steady)
    if len(steady) == len(result["steps"]) and warmup:
        row["warmup_included"] = True
    for key in ("predicted_seconds_per_step", "predicted_at_measured_length", "chosen_settings"):
        if key in result:
            row[key] = result[key]
    for phase in ("rollout", "reward", "update", "sync"):
        row[f"{phase}_s"] = mean(f"time/{phase}")
    generated = mean("completions/mean_length")
    row["mean_completion_len"] = generated
    longest = [step["completions/max_length"] for step in steady if "completions/max_length" in step]
    row["max_completion_len"] = max(longest) if longest else None
    row["per_step"] = [
        {
            key: step.get(key)
            for key in (
                "time/wall",
                "time/rollout",
                "time/update",
                "completions/mean_length",
                "sampling/sampling_logp_difference/mean",
                "sampling/sampling_logp_difference/max",
                "sampling/distribution_tv/max",
                "routing/mismatch_fraction",
            )
        }
        for step in result["steps"]
    ]
    if generated is not None and row["rollout_s"]:
        row["generated_tokens_per_s"] = COMPLETIONS * generated / row["rollout_s"]
        shared = bool(row.get("chosen_settings", {}).get("shared_prompts", {}).get("value"))
        trained, executed = update_tokens(COMPLETIONS, generated, shared)
        row["trained_tokens_per_s"] = trained / row["update_s"]
        if tflops:
            row["update_mfu"] = flops_per_token * num_params * trained / row["update_s"] / (tflops * 1e12)
            row["update_executed_mfu"] = row["update_mfu"] * executed / trained
    return row


def print_table(rows: list[dict]) -> None:
    keys = [
        "system",
        "seconds_per_step",
        "rollout_s",
        "reward_s",
        "update_s",
        "sync_s",
        "generated_tokens_per_s",
        "trained_tokens_per_s",
        "update_mfu",
        "update_executed_mfu",
        "mean_completion_len",
        "max_completion_len",
        "peak_gib",
        "steps_done",
    ]
    print(" | ".join(keys))
    for row in rows:
        cells = []
        for key in keys:
            value = row.get(key)
            cells.append("-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value))
        print(" | ".join(cells))
