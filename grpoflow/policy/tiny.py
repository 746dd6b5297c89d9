"""Tiny models and tokenizers built locally, with nothing downloaded.

They back the embedded default run and the tests: a character-level tokenizer (one token per
character, so rewards on text map one-to-one onto tokens) with a small chat template, and a small
randomly initialised decoder of any transformers architecture that takes a Llama-style config.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

DEFAULT_SEED = 42
"""The seed of a run and of a random model's initialisation when none is given: `grpoflow serve
--model tiny` builds the weights `grpoflow train --model tiny` starts from."""

DEFAULT_CHARS = string.ascii_lowercase + string.digits + string.ascii_uppercase + string.punctuation + " \n"

CHAT_TEMPLATE = (
    "{%- set start = 1 if messages and messages[0].role == 'system' else 0 %}"
    "{%- if start %}{{ messages[0].content }}{{ '\\n' }}{% endif %}"
    "{%- if tools %}<tools>{{ '\\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "</tools>{{ '\\n' }}Call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>{{ '\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[start:] %}"
    "{%- if message.role == 'assistant' %}{% if loop.index0 > 1 %}{{ '\\n' }}{% endif %}{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set function = call.function if call.function is defined else call %}"
    '<tool_call>{"name": {{ function.name | tojson }}, "arguments": '
    "{% if function.arguments is string %}{{ function.arguments }}{% else %}{{ function.arguments | tojson }}"
    "{%- endif %}}</tool_call>"
    "{%- endfor %}<eos>"
    "{%- elif message.role == 'tool' %}{{ '\\n' }}<tool_response>{{ '\\n' }}{{ message.content }}{{ '\\n' }}"
    "</tool_response>"
    "{%- else %}{% if not loop.first %}{{ '\\n' }}{% endif %}{{ message.content }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt and messages[start:] | length > 1 %}{{ '\\n' }}{% endif %}"
)
"""The character tokenizer's chat template: Qwen2.5's tool format (hermes) in plain text, with no
role markers (each would cost a dozen tokens of one character). A conversation of one user message
renders as its text, so a text prompt keeps the ids it has without a template; a later message
starts on a new line, as does the policy's next turn (but the first, which follows its prompt's
text; a turn renders in the history as it was prompted); an assistant turn ends with `<eos>` (so a
turn the policy ended with that token renders as it was sampled) after its calls, each
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a tool result is
`<tool_response>...</tool_response>`; tools are listed as JSON schemas in `<tools>` before the
conversation, after the system message's text."""


def build_char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """One token per character plus `<pad>` (id 0), `<eos>` (id 1) and `<unk>` (id 2), with
    `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = ["<pad>", "<eos>", "<unk>", *dict.fromkeys(chars)]
    vocab = {symbol: index for index, symbol in enumerate(symbols)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(
    vocab_size: int,
    *,
    model_type: str = "qwen2",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    eos_token_id: int = 1,
    pad_token_id: int = 0,
    **extra,
):
    """The config of a small causal LM (`model_type`: qwen2, llama, mistral, qwen3, qwen3_moe,
    gemma3_text, ...); `extra`: the model type's own fields (a MoE model's expert counts)."""
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        **extra,
    )


def build_tiny_model(
    vocab_size: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    **shape,
) -> PreTrainedModel:
    """A randomly initialised causal LM of `tiny_config(vocab_size, **shape)`'s shape."""
    config = tiny_config(vocab_size, **shape)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


QWEN3_30B_A3B = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "tiny-moe": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "tiny-gemma3": dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    ),
    "qwen2-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        max_position_embeddings=32768,
    ),
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3-30b-a3b-8l": {**QWEN3_30B_A3B, "num_hidden_layers": 8},
    "qwen2.5-7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
}
"""Shapes of randomly initialised models; `tiny-moe` a Qwen3-MoE of 8 experts, 2 per token;
`tiny-gemma3` a Gemma 3 text model of a sliding window layer (8 tokens) and a full attention one;
`qwen2-0.5b` is Qwen2-0.5B's (and Qwen2.5-0.5B's) shape, `qwen2.5-7b` Qwen2.5-7B's,
`qwen3-30b-a3b` Qwen3-30B-A3B's (30.5B parameters, 61 GB in bfloat16), `qwen3-30b-a3b-8l` the same
cut to 8 of its 48 layers (benchmarks)."""


def build_preset_model(name: str, tokenizer_size: int, **kwargs) -> PreTrainedModel:
    """A random model of a preset shape; the vocabulary is the tokenizer's unless the preset sets one."""
    shape = {"vocab_size": tokenizer_size, **_preset(name), **kwargs}
    return build_tiny_model(shape.pop("vocab_size"), **shape)


def preset_config(name: str, tokenizer_size: int):
    """The config of `build_preset_model(name, tokenizer_size)`, with no weights built."""
    shape = {"vocab_size": tokenizer_size, **_preset(name)}
    return tiny_config(shape.pop("vocab_size"), **shape)


def _preset(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def save_tiny_checkpoint(directory: str | Path, **model_kwargs) -> Path:
    """Write a char tokenizer and a tiny model to `directory` (loadable by `from_pretrained`)."""
    directory = Path(directory)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(len(tokenizer), **model_kwargs)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
