"""Requests of the OpenAI-compatible endpoints, read the way vLLM reads them, checked, and turned
into prompts (token ids) and our SamplingParams.

Fields this server does not implement (penalties on frequency or presence, logit bias, beam
search, structured outputs, prompt log-probs, top-N log-probs, streaming) are refused with a 400
naming the field when they are set to anything but their neutral value, rather than ignored; other
unknown fields are ignored, as vLLM ignores them. Defaults are OpenAI's (temperature 1, top_p 1,
max_tokens 16 for completions, the rest of the context for chat), not the model's
generation_config.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpoflow.engines.base import SamplingParams
from grpoflow.server.errors import RequestError

INT64 = 2**63
NEUTRAL = (None, False, 0, "", [], {})
UNSUPPORTED = (
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "prompt_logprobs",
    "logprob_token_ids",
    "use_beam_search",
    "include_stop_str_in_output",
    "suffix",
    "prompt_embeds",
    "echo",
    "stream",
)
"""Request fields refused unless neutral (unset, false, zero or empty)."""
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
"""Most stop strings a request may send, and the longest one."""
MAX_TEMPLATE_KWARGS = 64
MAX_TEMPLATE_KWARGS_CHARS = 64 * 1024
"""Most keys `chat_template_kwargs` may hold, and the most characters they take as JSON."""
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
     "add_generation_prompt", "continue_final_message", "return_dict"}
)  # fmt: skip
"""Arguments of the template call that the request sets through its own fields."""
MIN_REPETITION_PENALTY = 1e-3
"""repetition_penalty lies in [1e-3, 1e3]: further out, dividing or multiplying a logit by it
overflows to infinity."""
GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily, as vLLM does (dividing logits by 1e-300 would overflow)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served model allows."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    """Ids that end a completion unless ignore_eos (the tokenizer's and the model's EOS)."""
    max_sequences: int = 16384
    max_prompt_chars: int = 2**20
    """Longest text a request may send as a prompt or conversation, in characters."""
    trust_request_chat_template: bool = False
    """Whether a request's own `chat_template` is rendered (else refused)."""


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow", strict=True)
    """Strict: `"n": "3"` or `true` is not the integer 3 or 1, nor a boolean a token id (an integer
    stands for a float, as JSON writes them)."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool | None = False
    return_tokens_as_token_ids: bool | None = False
    add_special_tokens: bool | None = None
    best_of: int | None = None


class CompletionRequest(SamplingRequest):
    prompt: list[int] | list[list[int]] | str | list[str]
    logprobs: int | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    episode_id: str | None = None
    """The agent episode this turn belongs to (episodes.py), as `extra_body={"episode_id": ...}`."""

    @property
    def offers_tools(self) -> bool:
        """Whether the answer's tool calls are read: tools were sent and tool_choice is not none."""
        return bool(self.tools) and self.tool_choice != "none"


class GenerateRequest(SamplingRequest):
    """/generate, as vLLM's demo API server reads it: a prompt (text, or `{"prompt_token_ids": [...]}`)
    and SamplingParams fields at the top level (Atropos's VLLMServer sends this)."""

    prompt: str | dict[str, Any]
    logprobs: int | None = None


def parse(model: type[BaseModel], body: Any, limits: Limits):
    """The request `body` (parsed JSON) as `model`, checked against what this server serves."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name in UNSUPPORTED:
        if body.get(name) not in NEUTRAL:
            raise RequestError(
                f"{name}={body[name]!r} is not supported by grpoflow serve; leave it out", 400, name
            )
    if body.get("best_of") not in (None, 1):
        raise RequestError("best_of is not supported by grpoflow serve; use n", 400, "best_of")
    check_template_kwargs(body.get("chat_template_kwargs"))
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        raise RequestError(_describe(error)) from None
    if request.model not in (None, "", limits.model_name):
        raise RequestError(
            f"the model {request.model!r} is not served here; this server serves {limits.model_name!r}",
            404,
            "model",
        )
    return request


def check_template_kwargs(kwargs: Any) -> None:
    """A 400 unless `chat_template_kwargs` is a small object of plain names that the request's
    own fields do not set (its size is checked before anything walks it)."""
    if kwargs is None:
        return
    field = "chat_template_kwargs"
    if not isinstance(kwargs, dict):
        raise RequestError(f"{field} must be an object of template variables", 400, field)
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise RequestError(
            f"{field} holds {len(kwargs)} keys; at most {MAX_TEMPLATE_KWARGS} are taken", 400, field
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise RequestError(
            f"{field} sets {', '.join(reserved)}, which the request's own fields set: send them as those",
            400,
            field,
        )
    try:
        size = len(json.dumps(kwargs))
    except (RecursionError, ValueError):
        size = MAX_TEMPLATE_KWARGS_CHARS + 1
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise RequestError(
            f"{field} takes more than {MAX_TEMPLATE_KWARGS_CHARS} characters as JSON; send less", 400, field
        )


def _describe(error: ValidationError) -> str:
    problems = []
    for item in error.errors()[:5]:
        where = ".".join(str(part) for part in item["loc"]) or "body"
        problems.append(f"{where}: {item['msg']}")
    return "invalid request: " + "; ".join(problems)


# -- prompts ----------------------------------------------------------------------------------


def tokenize(
    tokenizer, text: str, add_special_tokens: bool, limits: Limits, field: str = "prompt"
) -> list[int]:
    """`text` as token ids; a 400 naming `field` for text over the limit or text the tokenizer
    cannot encode (a lone surrogate, for one)."""
    if len(text) > limits.max_prompt_chars:
        raise RequestError(
            f"{field} has {len(text)} characters, over this server's limit of {limits.max_prompt_chars} "
            f"(--max-prompt-chars)",
            400,
            field,
        )
    try:
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    except Exception as error:  # the tokenizer's own complaint about this text
        raise RequestError(f"{field} cannot be tokenised: {type(error).__name__}", 400, field) from None


def completion_prompts(request: CompletionRequest, tokenizer, limits: Limits) -> list[list[int]]:
    """The prompts of a /v1/completions request as token ids (text is tokenised here)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    if not prompt:
        return [[]]
    if sum(len(item) for item in prompt if isinstance(item, str)) > limits.max_prompt_chars:
        raise RequestError(
            f"the prompts exceed this server's limit of {limits.max_prompt_chars} characters "
            f"(--max-prompt-chars)",
            400,
            "prompt",
        )
    add_special = True if request.add_special_tokens is None else request.add_special_tokens
    return [
        tokenize(tokenizer, item, add_special, limits) if isinstance(item, str) else list(item)
        for item in prompt
    ]


TOOL_CHOICES = (None, "auto", "none")
"""tool_choice values served: a call cannot be forced (no constrained decoding here)."""


def generate_prompt(request: GenerateRequest, tokenizer, limits: Limits) -> list[int]:
    """The prompt of a /generate request as token ids (text is tokenised with special tokens, as
    vLLM does)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return tokenize(tokenizer, prompt, True, limits)
    ids = prompt.get("prompt_token_ids")
    if isinstance(ids, list) and len(ids) >= limits.max_model_len:  # before walking them
        raise RequestError(
            f"the prompt has {len(ids)} tokens, and this model's context is {limits.max_model_len} "
            f"(max_model_len) with room for one generated token: shorten it",
            400,
            "prompt",
        )
    if not isinstance(ids, list) or not all(type(token) is int for token in ids):
        raise RequestError(
            'prompt must be text or {"prompt_token_ids": [int, ...]}, got ' + repr(prompt)[:200],
            400,
            "prompt",
        )
    return list(ids)


def chat_messages(request: ChatCompletionRequest, tokenizer, limits: Limits) -> list[dict[str, Any]]:
    """The conversation, checked, as the chat template reads it (text content)."""
    if request.chat_template is not None and not limits.trust_request_chat_template:
        raise RequestError(
            "chat_template in a request is refused: a template is code the server would run; leave it "
            "out to use the model's template, or start the server with --trust-request-chat-template",
            400,
            "chat_template",
        )
    if len(json.dumps(request.messages, default=str)) > limits.max_prompt_chars:
        raise RequestError(
            f"messages exceed this server's limit of {limits.max_prompt_chars} characters (--max-prompt-chars)",
            400,
            "messages",
        )
    if request.tool_choice not in TOOL_CHOICES:
        raise RequestError(
            f"tool_choice={request.tool_choice!r}: grpoflow serve cannot force a tool call; "
            f"send 'auto' or 'none' (or leave it out)",
            400,
            "tool_choice",
        )
    if not request.messages:
        raise RequestError("messages is empty: give at least one message", 400, "messages")
    if request.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            "the tokenizer has no chat template: send one as chat_template, or use /v1/completions",
            400,
            "chat_template",
        )
    return [_plain_message(index, message) for index, message in enumerate(request.messages)]


def sandbox_arguments(request: ChatCompletionRequest, tokenizer) -> dict[str, Any]:
    """What a request's own chat template renders with in the sandbox (templates.py), besides
    the template and the messages: what transformers passes a template."""
    return {
        "tools": request.tools,
        "add_generation_prompt": request.add_generation_prompt,
        "continue_final_message": request.continue_final_message,
        **_special_tokens(tokenizer),
        **(request.chat_template_kwargs or {}),
    }


def chat_prompt(request: ChatCompletionRequest, tokenizer, limits: Limits) -> list[int]:
    """The conversation and its tools rendered by the chat template (the tokenizer's; the
    request's only where the server trusts request templates) in this process, as token ids."""
    text = chat_text(request, tokenizer, limits)
    return tokenize(tokenizer, text, bool(request.add_special_tokens), limits, "messages")


def chat_text(request: ChatCompletionRequest, tokenizer, limits: Limits) -> str:
    """`chat_prompt`'s rendered text, before it is tokenised."""
    messages = chat_messages(request, tokenizer, limits)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=request.chat_template,
            tools=request.tools,
            **(request.chat_template_kwargs or {}),
        )
    except Exception as error:  # a template is user code: any failure is the request's
        raise RequestError(f"the chat template failed on these messages: {error}", 400, "messages") from None
    return text


def _special_tokens(tokenizer) -> dict[str, Any]:
    """The special tokens a template reads (bos_token, eos_token, ...), as transformers passes them."""
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {name: value for name, value in tokens.items() if isinstance(value, str | list)}


def _plain_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    if "role" not in message:
        raise RequestError(f"messages[{index}] has no role", 400, "messages")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    f"messages[{index}] has a {kind!r} part: grpoflow serve takes text only", 400, "messages"
                )
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    plain = {**message, "content": content}
    if isinstance(message.get("tool_calls"), list):
        plain["tool_calls"] = [_template_call(call) for call in message["tool_calls"]]
    return plain


def _template_call(call: Any) -> Any:
    """An OpenAI tool call with its `function.arguments` JSON string decoded, as chat templates
    (Qwen's, Llama's) expect them and as vLLM hands them over; arguments that are no JSON object
    stay as sent."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


# -- sampling ---------------------------------------------------------------------------------


def check_prompts(prompts: list[list[int]], max_tokens: int, n: int, limits: Limits) -> None:
    """Refuse prompts the engine could not serve, naming the prompt and the fix."""
    if len(prompts) * n > limits.max_sequences:
        raise RequestError(
            f"{len(prompts)} prompts x n={n} is {len(prompts) * n} sequences, over this server's "
            f"limit of {limits.max_sequences} per request: split the request",
            400,
            "n",
        )
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise RequestError(f"prompt {index} is empty: give at least one token", 400, "prompt")
        if len(prompt) + max_tokens > limits.max_model_len:  # first: it bounds the range check
            raise RequestError(
                f"prompt {index} has {len(prompt)} tokens and max_tokens is {max_tokens}: "
                f"{len(prompt) + max_tokens} tokens exceed this model's context of "
                f"{limits.max_model_len} (max_model_len); shorten the prompt or lower max_tokens",
                400,
                "max_tokens",
            )
        if min(prompt) < 0 or max(prompt) >= limits.vocab_size:
            raise RequestError(
                f"prompt {index} has token ids outside [0, {limits.vocab_size})", 400, "prompt"
            )


def completion_max_tokens(request: CompletionRequest) -> int:
    return 16 if request.max_tokens is None else request.max_tokens


def chat_max_tokens(request: ChatCompletionRequest, prompt: list[int], limits: Limits) -> int:
    """max_completion_tokens, else max_tokens, else what the context leaves after the prompt."""
    for value in (request.max_completion_tokens, request.max_tokens):
        if value is not None:
            return value
    room = limits.max_model_len - len(prompt)
    if room < 1:
        raise RequestError(
            f"the rendered conversation has {len(prompt)} tokens, which leaves no room for a completion "
            f"within this model's context of {limits.max_model_len} (max_model_len); shorten it",
            400,
            "messages",
        )
    return room


def sampling_params(request: SamplingRequest, max_tokens: int, limits: Limits) -> SamplingParams:
    """Our SamplingParams for the request; out-of-range values are a 400 naming the field."""
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}", 400, "max_tokens")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = getattr(request, name)
        if value is not None and not math.isfinite(value):
            raise RequestError(f"{name} must be a finite number, got {value}", 400, name)
    penalty = request.repetition_penalty
    if penalty is not None and not MIN_REPETITION_PENALTY <= penalty <= 1 / MIN_REPETITION_PENALTY:
        raise RequestError(
            f"repetition_penalty must lie in [{MIN_REPETITION_PENALTY:g}, {1 / MIN_REPETITION_PENALTY:g}] "
            f"(1 is none), got {penalty:g}",
            400,
            "repetition_penalty",
        )
    top_k = -1 if request.top_k in (None, 0) else request.top_k
    if top_k < -1:
        raise RequestError(f"top_k must be -1 or 0 (all tokens) or positive, got {top_k}", 400, "top_k")
    stop_ids = list(request.stop_token_ids or [])
    if any(not 0 <= token < limits.vocab_size for token in stop_ids):
        raise RequestError(f"stop_token_ids must lie in [0, {limits.vocab_size})", 400, "stop_token_ids")
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(len(stop) > MAX_STOP_CHARS for stop in stops):
        raise RequestError(
            f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each",
            400,
            "stop",
        )
    temperature = 1.0 if request.temperature is None else request.temperature
    try:
        return SamplingParams(
            n=request.n,
            max_tokens=max_tokens,
            temperature=0.0 if 0 <= temperature < GREEDY_BELOW else temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=top_k,
            min_p=0.0 if request.min_p is None else request.min_p,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            # under ignore_eos the EOS ids are no stops: vLLM's engine stops at any stop_token_ids
            stop_token_ids=list(
                dict.fromkeys(stop_ids + ([] if request.ignore_eos else list(limits.eos_token_ids)))
            ),
            stop=[stop for stop in stops if stop],
            ignore_eos=request.ignore_eos,
            seed=request.seed,
        )
    except ValueError as error:
        message = str(error).replace("SamplingParams.", "")
        raise RequestError(message, 400, message.split(" ", 1)[0]) from None
