"""A recorded episode's next prompt built on the tokens it already sampled.

An agent program sends its whole conversation with every turn, as text: the assistant turns it was
answered, the tool results and user turns since. Tokenised again, that text often differs from
what the model sampled (text decodes to the same string from many token sequences, and special
tokens the answer hid come back as nothing), so the new prompt would not extend the previous
turn's tokens: the episode would train as several sequences, each carrying its history again, and
the engine's prefix cache would miss the turns just sampled.

So each recorded turn leaves its episode the text of its prompt and of its completion as the
program received it (with the stop token's text, which the chat template writes back): with the
turn's token ids, the episode's `Resume`. When the next turn's rendered prompt starts with that text,
its ids are those token ids followed by the rest of the text tokenised alone: the conversation
the program sent, token for token the one the model sampled. A prompt that does not start with
it (a template that drops earlier reasoning, a program that rewrote or truncated its history) is
tokenised whole, as any request is.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from grpoflow.engines.base import Completion
from grpoflow.server.protocol import Limits, tokenize


@dataclass(frozen=True, slots=True)
class Resume:
    """The text of an episode's last prompt and completion, and the token ids the engine saw
    (the episode recorder keeps the text beside the turn, whose ids these are)."""

    text: str
    ids: array  # int32


def resume_text(prompt_text: str, completion: Completion, tokenizer, skip_special_tokens: bool) -> str:
    """What a turn leaves its episode's next prompt to extend: its rendered prompt, then its
    completion's `sampled_text`."""
    stopped = completion.finish_reason == "stop"
    return prompt_text + sampled_text(completion.token_ids, stopped, tokenizer, skip_special_tokens)


def sampled_text(token_ids: list[int], stopped: bool, tokenizer, skip_special_tokens: bool) -> str:
    """The completion's text as its answer carried it, then, when a special token `stopped` it,
    that token's text: the answer leaves it out and the chat template writes it back after the
    message (a model's end-of-turn token)."""
    stop = stopped and bool(token_ids) and token_ids[-1] in tokenizer.all_special_ids
    body = token_ids[:-1] if stop else token_ids
    text = tokenizer.decode(body, skip_special_tokens=skip_special_tokens)
    return text + tokenizer.decode(token_ids[-1:], skip_special_tokens=False) if stop else text


def prompt_ids(
    text: str, resume: Resume | None, tokenizer, add_special_tokens: bool, limits: Limits
) -> list[int]:
    """The rendered chat prompt `text` as token ids: `resume`'s ids and the rest tokenised alone
    when `text` extends its text, else `text` tokenised whole."""
    if resume is None or not text.startswith(resume.text) or len(text) > limits.max_prompt_chars:
        return tokenize(tokenizer, text, add_special_tokens, limits, "messages")
    rest = text[len(resume.text) :]
    return resume.ids.tolist() + (tokenize(tokenizer, rest, False, limits, "messages") if rest else [])
