"""The inputs of benchmarks/grpo_step.py's workloads, written to a directory both systems read: a
random-initialised model of a preset's shape with the character tokenizer (in bfloat16, and in
float32 when asked; for the long tail its end-of-sequence logit raised), and files of random
128-character prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from step_report import PROMPT_TOKENS


def raise_eos_probability(model, mean_length: float, *, rows: int = 8, length: int = 640) -> float:
    """Bias the last layer's values so that EOS gets about `1 / mean_length` of the probability
    at every position of random text; returns the probability measured.

    The value bias passes through attention unchanged (attention weights sum to 1) and o_proj
    turns it into one vector added to every position's residual stream: the bias is the least
    squares solution putting that vector along the EOS output embedding, scaled by bisection.
    """
    attention = model.model.layers[-1].self_attn
    config, device = model.config, next(model.parameters()).device
    eos = config.eos_token_id
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    group = config.num_attention_heads // config.num_key_value_heads
    # o_proj's input for a value bias b: b of each kv head, repeated for the query heads it serves.
    repeat = torch.eye(config.num_key_value_heads * head_dim, device=device).view(
        config.num_key_value_heads, 1, head_dim, -1
    )
    repeat = repeat.expand(-1, group, -1, -1).reshape(config.num_attention_heads * head_dim, -1)
    direction = model.get_output_embeddings().weight[eos].float()
    unit_bias = torch.linalg.lstsq(attention.o_proj.weight.float() @ repeat, direction[:, None]).solution[
        :, 0
    ]
    unit_bias = unit_bias / unit_bias.norm()
    ids = torch.randint(3, config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def eos_probability(scale: float) -> float:
        attention.v_proj.bias.copy_(scale * unit_bias)
        logits = model(input_ids=ids.to(device)).logits.float()
        return float(torch.softmax(logits, dim=-1)[..., eos].mean())

    target, low, high = 1.0 / mean_length, 0.0, 1.0
    if eos_probability(0.0) >= target:
        return eos_probability(0.0)
    while eos_probability(high) < target and high < 1e6:
        low, high = high, 2 * high
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if eos_probability(middle) < target else (low, middle)
    return eos_probability(high)


def write_model(
    directory: Path, smoke: bool, float32_copy: bool, eos_mean_length: float | None, preset: str
) -> None:
    """The random model and the tokenizer, in bfloat16 (and float32 when asked)."""
    from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model, build_tiny_model

    tokenizer = build_char_tokenizer()
    if smoke:
        model = build_tiny_model(len(tokenizer), dtype=torch.bfloat16)
    else:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init on the GPU: seconds
            model = build_preset_model(preset, len(tokenizer), dtype=torch.bfloat16)
    if eos_mean_length is not None:
        model.to("cuda" if torch.cuda.is_available() else "cpu")
        probability = raise_eos_probability(model, eos_mean_length)
        print(f"EOS probability per token: {probability:.5f} (target {1 / eos_mean_length:.5f})")
        model.to("cpu")
        torch.cuda.empty_cache()
    model.save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    if float32_copy:
        model = model.float()
        model.config.dtype = torch.float32  # from_pretrained's "auto" dtype reads it
        model.save_pretrained(directory / "model-fp32")
        tokenizer.save_pretrained(directory / "model-fp32")


def write_inputs(
    directory: Path,
    smoke: bool,
    num_prompts: int,
    float32_copy: bool = False,
    eos_mean_length: float | None = None,
    preset: str = "qwen2-0.5b",
    in_memory: bool = False,
) -> tuple[Path, Path]:
    """The random model (unless `in_memory`: grpoflow then builds `random:PRESET` on its own
    device) and the prompts, written under `directory`."""
    if not in_memory:
        write_model(directory, smoke, float32_copy, eos_mean_length, preset)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    with open(directory / "prompts.jsonl", "w") as handle:
        for _ in range(num_prompts):
            handle.write(
                json.dumps({"prompt": "".join(rng.choice(letters) for _ in range(PROMPT_TOKENS))}) + "\n"
            )
    return directory / "model", directory / "prompts.jsonl"
