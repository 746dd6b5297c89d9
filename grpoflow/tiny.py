"""Tiny models and tokenizers built locally, with nothing downloaded.

They back the embedded default run and the tests: a character-level tokenizer (one token per
character, so rewards on text map one-to-one onto tokens) and a small randomly initialised
decoder of any transformers architecture that takes a Llama-style config.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

DEFAULT_CHARS = string.ascii_lowercase + string.digits + " +-=:?.,!<>/\n"


def build_char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character plus `<pad>` (id 0) and `<eos>` (id 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = ["<pad>", "<eos>", *dict.fromkeys(chars)]
    vocab = {symbol: index for index, symbol in enumerate(symbols)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")


def build_tiny_model(
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
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    eos_token_id: int = 1,
    pad_token_id: int = 0,
) -> PreTrainedModel:
    """A randomly initialised causal LM (`model_type`: qwen2, llama, mistral, qwen3, ...)."""
    config = AutoConfig.for_model(
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
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.eos_token_id = eos_token_id
    return model


def save_tiny_checkpoint(directory: str | Path, **model_kwargs) -> Path:
    """Write a char tokenizer and a tiny model to `directory` (loadable by `from_pretrained`)."""
    directory = Path(directory)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(len(tokenizer), **model_kwargs)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
