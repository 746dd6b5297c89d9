"""Agent programs for the tests, written as a user writes them: against the `openai` client they
are given. Each remembers what the server answered it (token ids and log-probs, which the server
returns on request) in SEEN, by the row's `id`, so tests can check the training sequence against
what was sampled."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import openai

from grpoflow.chat.trajectory import EPISODE_HEADER

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
"""One OpenAI-style tool, `add`, offered by the programs and the episode tests."""
ARGUMENTS = {"a": 2, "b": 3}
TEMPLATE = (
    r"{%- if tools %}{{- 's:tools' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}"
    r"{{- '\n' }}{%- endif %}"
    r"{%- for m in messages %}"
    r"{%- if m.role == 'assistant' %}{{- 'a:' }}{%- if m.content %}{{- m.content }}{%- endif %}"
    r"{%- for call in m.tool_calls or [] %}"
    r"{{- '<call>' + call.function.name + ' ' + (call.function.arguments | tojson) + '</call>' }}"
    r"{%- endfor %}{{- '<eos>\n' }}"
    r"{%- elif m.role == 'tool' %}{{- 't:' + m.content + '\n' }}"
    r"{%- else %}{{- m.role[0] + ':' + m.content + '\n' }}{%- endif %}"
    r"{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- 'a:' }}{%- endif %}"
)
"""A chat template with tools in the character tokenizer's alphabet; an assistant turn ends with
`<eos>`, the tokenizer's end-of-sequence token, as Qwen's ends with `<|im_end|>`."""

SEEN: dict[str, list[dict]] = {}
"""Per row id: each turn's prompt_token_ids, token_ids and log-probs as the server answered."""
RELEASE = threading.Event()
"""What `hanging_sync_agent` waits for: set, the programs still hanging return."""


async def ask(client: openai.AsyncOpenAI, model: str, row: dict, messages: list[dict], **options):
    """One chat turn, remembered in SEEN; the program asks for greedy sampling and long turns,
    which the run's settings override."""
    reply = await client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0.0,
        max_tokens=100,
        logprobs=True,
        extra_body={"return_token_ids": True, **options},
    )
    data = reply.model_dump()
    choice = data["choices"][0]
    SEEN.setdefault(row["id"], []).append(
        {
            "prompt_ids": data["prompt_token_ids"],
            "completion_ids": choice["token_ids"],
            "logprobs": [entry["logprob"] for entry in choice["logprobs"]["content"]],
        }
    )
    return reply.choices[0].message


async def tool_agent(client: openai.AsyncOpenAI, model: str, row: dict) -> float:
    """Three turns: a question, the answer of a tool the program runs itself, a follow-up."""
    messages = [{"role": "user", "content": row["question"]}]
    first = await ask(client, model, row, messages, tools=TOOLS)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": json.dumps(ARGUMENTS)},
    }
    messages += [
        {"role": "assistant", "content": first.content, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    second = await ask(client, model, row, messages, tools=TOOLS)
    messages += [{"role": "assistant", "content": second.content}, {"role": "user", "content": "sure?"}]
    await ask(client, model, row, messages, tools=TOOLS)
    return 1.0


async def dispatch(client: openai.AsyncOpenAI, model: str, row: dict) -> float | None:
    """Behaves as the row's `behaviour` says: ok, raise, hang, rewrite (history), none (no turn),
    block (blocks its event loop for 30 s) or die (kills its own process after one turn): the last
    two only in an agent worker process."""
    behaviour = row["behaviour"]
    if behaviour == "none":
        return 0.5
    messages = [{"role": "user", "content": row["question"]}]
    first = await ask(client, model, row, messages)
    if behaviour == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if behaviour == "block":
        time.sleep(30)
    if behaviour == "raise":
        raise RuntimeError("the tool broke")
    if behaviour == "hang":
        await asyncio.sleep(60)
    if behaviour == "rewrite":  # the program summarises the conversation in a new first message
        messages = [{"role": "user", "content": "so far: " + (first.content or "")}]
        second = await ask(client, model, row, messages)
        messages += [{"role": "assistant", "content": second.content}, {"role": "user", "content": "more"}]
        await ask(client, model, row, messages)
    return 0.25


def endless_sync_agent(client: openai.OpenAI, model: str, row: dict) -> float:
    """A plain function on the synchronous client: asks again and again, until refused. Special
    tokens stay in the text it gets back, so its history renders as sampled."""
    messages = [{"role": "user", "content": row["question"]}]
    while True:
        reply = client.chat.completions.create(
            model=model, messages=messages, extra_body={"skip_special_tokens": False}
        )
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": "go on"}]


def hanging_sync_agent(client: openai.OpenAI, model: str, row: dict) -> float:
    """A plain function that hangs, past any timeout, until RELEASE is set."""
    RELEASE.wait()
    return 0.0


async def chatty_agent(client: openai.AsyncOpenAI, model: str, row: dict) -> float:
    """Three user turns, each answer appended to the history as the program received it; the
    row's `template_kwargs` go to the chat template (Qwen3's `enable_thinking`)."""
    options = {"chat_template_kwargs": row["template_kwargs"]} if row.get("template_kwargs") else {}
    messages = [{"role": "user", "content": row["question"]}]
    for follow_up in ("more", "again", None):
        reply = await ask(client, model, row, messages, **options)
        if follow_up is not None:
            messages += [
                {"role": "assistant", "content": reply.content},
                {"role": "user", "content": follow_up},
            ]
    return 1.0


async def forgetful_agent(client: openai.AsyncOpenAI, model: str, row: dict) -> float:
    """Four turns; before the third the program forgets the first exchange (keeps the last one),
    so the third and fourth turns do not extend the first two."""
    messages = [{"role": "user", "content": row["question"]}]
    first = await ask(client, model, row, messages)
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "more"}]
    second = await ask(client, model, row, messages)
    messages = [
        *messages[2:],
        {"role": "assistant", "content": second.content},
        {"role": "user", "content": "go"},
    ]
    third = await ask(client, model, row, messages)
    messages += [{"role": "assistant", "content": third.content}, {"role": "user", "content": "end"}]
    await ask(client, model, row, messages)
    return 1.0


async def relay_at(client: openai.AsyncOpenAI, model: str, row: dict, **sampling) -> float:
    """The relay task (`grpoflow.tasks.relay_agent`) on its row's first two letters, each turn
    asking for `sampling` (and four tokens unless it says otherwise)."""
    from grpoflow.tasks.relay_agent import CHAT_TEMPLATE

    letters, options = row["letters"][:2], {"max_tokens": 4, **sampling}
    messages = [{"role": "user", "content": f"echo {letters[0]}:"}]
    for index in range(len(letters)):
        reply = await client.chat.completions.create(
            model=model, messages=messages, extra_body={"chat_template": CHAT_TEMPLATE}, **options
        )
        if index + 1 < len(letters):
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": f"echo {letters[index + 1]}:"},
            ]
    return 0.5 if letters[0] < "e" else 0.0


async def choosy_relay(client: openai.AsyncOpenAI, model: str, row: dict) -> float:
    """The relay asking for sampling of its own (greedy, a nucleus), through the client it is given."""
    return await relay_at(client, model, row, temperature=0.0, top_p=0.5)


async def bypassing_relay(client: openai.AsyncOpenAI, model: str, row: dict) -> float:
    """One relay turn ("echo a:") through a client of its own (the given one's server, key and
    episode header), so that it reaches the server greedy, as asked: one token, whose score at
    temperature 1 (a greedy draw's) equals the trainer's log-prob bit for bit on the CPU."""
    own = openai.AsyncOpenAI(
        base_url=str(client.base_url),
        api_key=client.api_key,
        default_headers={EPISODE_HEADER: client.default_headers[EPISODE_HEADER]},
        max_retries=0,
        timeout=client.timeout,
    )
    async with own:
        return await relay_at(own, model, {**row, "letters": "a"}, temperature=0.0, max_tokens=1)
