"""Response bodies of /v1/completions, /v1/chat/completions and /generate, in vLLM's shape.

The fields RL clients read: each choice's `token_ids` and `prompt_token_ids` (when the request set
`return_token_ids`), the chat response's top-level `prompt_token_ids`, and the sampled tokens'
log-probs (`logprobs.token_logprobs` for completions, `logprobs.content[i].logprob` for chat),
which are log_softmax(logits / temperature) of the sampled token, as vLLM reports them with
`--logprobs-mode processed_logprobs`. With `return_tokens_as_token_ids` tokens are written
`token_id:ID`, as vLLM writes them.

A chat request that offers `tools` gets the calls in its answer's text as OpenAI `tool_calls`
(read by grpoflow.chat.tool_calls in the server's `tool_call_parser` format) and the finish
reason `tool_calls`. As in vLLM, a text with any call that cannot be read is answered as plain
content, whole, with no `tool_calls`: the agent sees what the model wrote.
"""

from __future__ import annotations

import json
import time
import uuid

from grpoflow.chat.tool_calls import ToolCall, parse_tool_calls
from grpoflow.engines.base import Completion
from grpoflow.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

LOGPROB_FLOOR = -9999.0
"""JSON has no -inf: log-probs are floored here, as OpenAI and vLLM do."""


def completion_response(
    request: CompletionRequest,
    model: str,
    prompts: list[list[int]],
    groups: list[list[Completion]],
    tokenizer,
) -> dict:
    choices = []
    for prompt, group in zip(prompts, groups):
        for completion in group:
            choice = {
                "index": len(choices),
                "text": _text(completion, tokenizer, request.skip_special_tokens),
                "logprobs": None,
                "finish_reason": completion.finish_reason,
                "stop_reason": None,
            }
            if request.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(completion, tokenizer, request)
            if request.return_token_ids:
                choice["prompt_token_ids"] = prompt
                choice["token_ids"] = completion.token_ids
            choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(prompts, groups),
    }


def chat_response(
    request: ChatCompletionRequest,
    model: str,
    prompt: list[int],
    group: list[Completion],
    tokenizer,
    tool_call_parser: str = "auto",
) -> dict:
    choices = []
    for index, completion in enumerate(group):
        text = _text(completion, tokenizer, request.skip_special_tokens)
        message = assistant_message(text, tool_call_parser if request.offers_tools else None, request.tools)
        choice = {
            "index": index,
            "message": message,
            "logprobs": {"content": _chat_logprobs(completion, tokenizer, request)}
            if request.logprobs
            else None,
            "finish_reason": "tool_calls" if message["tool_calls"] else completion.finish_reason,
            "stop_reason": None,
        }
        if request.return_token_ids:
            choice["token_ids"] = completion.token_ids
        choices.append(choice)
    response = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage([prompt], [group]),
    }
    if request.return_token_ids:
        response["prompt_token_ids"] = prompt
    return response


def assistant_message(text: str, tool_call_parser: str | None, tools: list[dict] | None = None) -> dict:
    """The assistant message answering with `text`: with a parser, the calls in it as OpenAI
    `tool_calls` (arguments typed by `tools`' schemas where the format needs it) and the text
    outside them as content (None when empty); without one, or when a call is malformed, the whole
    text as content."""
    if tool_call_parser is not None:
        parsed = parse_tool_calls(text, tool_call_parser, tools)
        if parsed.calls and all(isinstance(call, ToolCall) for call in parsed.calls):
            calls = [openai_tool_call(call) for call in parsed.calls]
            return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}
    return {"role": "assistant", "content": text, "tool_calls": []}


def openai_tool_call(call: ToolCall) -> dict:
    """`call` as an entry of OpenAI's `tool_calls` (arguments as a JSON string)."""
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def generate_response(
    request: GenerateRequest, prompt: list[int], group: list[Completion], tokenizer
) -> dict:
    """/generate's answer as Atropos's vLLM server gives it (example_trainer/vllm_api_server.py):
    `text` (completions only), `prompt` and `finish_reasons`; with `logprobs` set, also per
    completion one `[{"ID": logprob}]` per sampled token, `token_ids` and `prompt_token_ids`."""
    response = {
        "text": [_text(completion, tokenizer, request.skip_special_tokens) for completion in group],
        "prompt": request.prompt if isinstance(request.prompt, str) else tokenizer.decode(prompt),
        "finish_reasons": [completion.finish_reason for completion in group],
    }
    if request.logprobs is not None:
        response["logprobs"] = [
            [[{str(token): max(value, LOGPROB_FLOOR)}] for token, value in zip(c.token_ids, c.logprobs)]
            for c in group
        ]
        response["prompt_token_ids"] = prompt
        response["token_ids"] = [completion.token_ids for completion in group]
    return response


def _text(completion: Completion, tokenizer, skip_special_tokens: bool) -> str:
    if completion.text is not None and skip_special_tokens:
        return completion.text  # the engine's decode, already cut at a stop string
    return tokenizer.decode(completion.token_ids, skip_special_tokens=skip_special_tokens)


def _token(token_id: int, tokenizer, as_id: bool) -> str:
    return f"token_id:{token_id}" if as_id else tokenizer.decode([token_id])


def _completion_logprobs(completion: Completion, tokenizer, request: CompletionRequest) -> dict:
    tokens = [
        _token(token, tokenizer, bool(request.return_tokens_as_token_ids)) for token in completion.token_ids
    ]
    values = [max(value, LOGPROB_FLOOR) for value in completion.logprobs]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": [{token: value} for token, value in zip(tokens, values)],
    }


def _chat_logprobs(completion: Completion, tokenizer, request: ChatCompletionRequest) -> list[dict]:
    entries = []
    for token_id, value in zip(completion.token_ids, completion.logprobs):
        token = _token(token_id, tokenizer, bool(request.return_tokens_as_token_ids))
        entries.append(
            {
                "token": token,
                "logprob": max(value, LOGPROB_FLOOR),
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [],
            }
        )
    return entries


def _usage(prompts: list[list[int]], groups: list[list[Completion]]) -> dict:
    prompt_tokens = sum(len(prompt) for prompt in prompts)
    completion_tokens = sum(len(completion.token_ids) for group in groups for completion in group)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
