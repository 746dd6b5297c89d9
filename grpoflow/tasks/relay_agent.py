"""The relay task (`grpoflow.tasks.relay`) played by an agent program on the `openai` client: the
program asks the policy to echo a letter, scores the answer, names the next letter, and returns
the mean score as the episode's reward (`agent_program: grpoflow.tasks.relay_agent:play`).

The program sends a chat template of its own with each request (`chat_template`, a vLLM extension
of the chat request), which marks each turn's role (`u:`, `a:`); it closes every assistant turn
with `<eos>`, the tokenizer's end-of-sequence token, so that a turn the policy ended with that
token renders exactly as it was sampled.
"""

from __future__ import annotations

from typing import Any

from grpoflow.tasks.relay import TURN_LENGTH

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'][0] }}:{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}<eos>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
"""`u:echo c:\\na:` and so on: one character per token in the tiny model's tokenizer."""


async def play(client: Any, model: str, row: dict) -> float:
    """One relay episode: a turn per letter of `row["letters"]`; the mean share of each turn's
    first TURN_LENGTH characters equal to its letter."""
    letters = row["letters"]
    messages = [{"role": "user", "content": f"echo {letters[0]}:"}]
    scores = []
    for index, letter in enumerate(letters):
        reply = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=TURN_LENGTH,
            extra_body={"chat_template": CHAT_TEMPLATE},
        )
        text = reply.choices[0].message.content or ""
        scores.append(sum(char == letter for char in text[:TURN_LENGTH]) / TURN_LENGTH)
        if index + 1 < len(letters):
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"echo {letters[index + 1]}:"},
            ]
    return sum(scores) / len(letters)
