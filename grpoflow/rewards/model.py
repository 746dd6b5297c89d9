"""A reward model (a sequence classifier with one output) used as a reward function."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grpoflow.rewards.text import content_text


class RewardModel:
    """Scores prompt + completion with `AutoModelForSequenceClassification` (num_labels=1).

    Conversations are rendered with the tokenizer's chat template when it has one (prompt messages
    followed by the completion's messages); otherwise, and for plain strings, the texts are
    concatenated. Inputs longer than `max_length` tokens keep their end, where the completion is.

    Args:
        path_or_name: local directory or hub name of the model and its tokenizer.
        device: where to run it ("cpu", "cuda", "cuda:1", ...).
        dtype: weights' dtype.
        max_length: most tokens per scored text.
        batch_size: texts per forward pass.
    """

    def __init__(
        self,
        path_or_name: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_length: int = 2048,
        batch_size: int = 8,
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if max_length < 1 or batch_size < 1:
            raise ValueError(f"max_length and batch_size must be >= 1, got {max_length} and {batch_size}")
        self.tokenizer = AutoTokenizer.from_pretrained(path_or_name)
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(
                    f"The tokenizer of {path_or_name!r} has neither a pad nor an EOS token; add a pad token."
                )
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.truncation_side = "left"
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path_or_name, num_labels=1, dtype=dtype
        )
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"{path_or_name!r} has {self.model.config.num_labels} labels; a reward model needs 1."
            )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval()
        self.device = torch.device(device)
        self.max_length = max_length
        self.batch_size = batch_size
        self.__name__ = f"reward_model:{path_or_name}"

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The strings the model scores, one per completion."""
        return [self._render(prompt, completion) for prompt, completion in zip(prompts, completions)]

    @torch.inference_mode()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        texts = self.texts(prompts, completions)
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            encoded = self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
                add_special_tokens=False,
            ).to(self.device)
            logits = self.model(
                input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]
            ).logits
            scores.extend(logits[:, 0].float().cpu().tolist())  # logits: (batch, 1)
        return scores

    def _render(self, prompt: Any, completion: Any) -> str:
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt + completion
        if self.tokenizer.chat_template is not None and not isinstance(prompt, str):
            messages = list(prompt) + (
                [{"role": "assistant", "content": completion}]
                if isinstance(completion, str)
                else list(completion)
            )
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return _plain(prompt) + _plain(completion)


def _plain(item: Any) -> str:
    if isinstance(item, str):
        return item
    return "\n".join(content_text([message]) for message in item)
