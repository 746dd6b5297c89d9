"""Token ids for what an environment says between two policy turns, appended to the ids the
engine sampled, never re-tokenising the conversation so far (which need not give the same ids).

With a chat template, the ids are the difference between a short conversation rendered with and
without the new messages (tool results, a user turn), starting right after the end-of-turn token
the policy sampled; text the template puts after that token ("\\n" in Qwen's) comes with them.
Without a chat template, the messages are plain text lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]


class TurnRenderer:
    """Renders environment messages as token ids for one tokenizer (and its chat template)."""

    def __init__(self, tokenizer, tools: Sequence[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.end_of_turn = tokenizer.eos_token_id

    def prompt_ids(self, prompt: str | list[Message]) -> list[int]:
        """The first prompt's ids: a conversation through the chat template (with the tools), a
        text as it is."""
        if isinstance(prompt, list) and self.chat:
            text = self.tokenizer.apply_chat_template(
                prompt, tools=self.tools, add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        if isinstance(prompt, list):
            prompt = "\n".join(str(message.get("content", "")) for message in prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def suffix_ids(self, messages: Sequence[Message], ended_turn: bool) -> list[int]:
        """Ids of `messages` after a policy turn, up to where the policy speaks again.
        `ended_turn`: the policy's last token was its end-of-turn token."""
        if not self.chat:
            text = "".join(f"\n{_text(message)}" for message in messages) + "\n"
            return self.tokenizer.encode(text, add_special_tokens=False)
        before, after = self._rendered(messages)
        eos = self.tokenizer.eos_token or ""
        cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
        suffix = before[cut:] + after[len(before) :]
        if not ended_turn and eos:
            suffix = eos + suffix  # the turn ended by a stop string or a tool-call tag: close it
        return self.tokenizer.encode(suffix, add_special_tokens=False)

    def _rendered(self, messages: Sequence[Message]) -> tuple[str, str]:
        tool_calls = [
            {"type": "function", "function": {"name": message.get("name", "tool"), "arguments": {}}}
            for message in messages
            if message.get("role") == "tool"
        ]
        assistant: Message = {"role": "assistant", "content": "x"}
        if tool_calls:
            assistant["tool_calls"] = tool_calls
        base = [{"role": "user", "content": "x"}, assistant]
        before = self.tokenizer.apply_chat_template(base, tools=self.tools, tokenize=False)
        after = self.tokenizer.apply_chat_template(
            base + list(messages), tools=self.tools, add_generation_prompt=True, tokenize=False
        )
        if not after.startswith(before):
            raise ValueError(
                "the chat template renders an earlier turn differently once a later message follows, so "
                "environment turns cannot be appended as token ids; use a template that renders turns "
                "independently"
            )
        return before, after


def _text(message: Message) -> str:
    content = message.get("content", "")
    if message.get("role") == "tool":
        return f"<tool_response>\n{content}\n</tool_response>"
    return str(content)
