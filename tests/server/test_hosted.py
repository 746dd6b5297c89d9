"""The serve app hosted around an engine its owner keeps: answered only while open, behind a
random key, and never closing the borrowed engine."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

openai = pytest.importorskip("openai")

from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpoflow.server.hosted import BorrowedEngine, host_engine  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m.role[0] }}:{{ m.content }}\n{% endfor %}a:"


class ClosingEngine:
    """Counts close() calls on a real engine; its generate takes no `abandoned` hook."""

    def __init__(self, engine) -> None:
        self.engine, self.closed = engine, 0
        self.capabilities = dataclasses.replace(engine.capabilities, aborts=False)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params, on_error="raise", intake=None):
        return self.engine.generate(prompts, params, on_error=on_error, intake=intake)

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def hosted():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    model = build_tiny_model(len(tokenizer), model_type="llama").eval()
    options = EngineOptions(engine=EngineConfig(max_model_len=256, max_num_seqs=8))
    engine = ClosingEngine(build_engine("native", model, tokenizer, options))
    server = host_engine(engine, tokenizer, model_name="policy", max_model_len=256)
    yield server, engine
    server.stop()


def test_requests_wait_while_closed_and_are_answered_and_recorded_while_open(hosted):
    server, engine = hosted
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=1.0, headers=auth(server))
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401  # the random key guards it
    server.open()
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.api_key, default_headers={"X-Episode-Id": "e1"}
    )
    reply = client.chat.completions.create(model="policy", messages=body["messages"], max_tokens=3)
    assert reply.usage.completion_tokens <= 3
    recorded = httpx.get(f"{server.url}/v1/episodes/e1", headers=auth(server), timeout=10).json()
    assert recorded["num_turns"] == 1
    server.close()
    server.stop()
    assert engine.closed == 0  # the owner closes its engine, not the server
    engine.generate([[5, 6]], SamplingParams(max_tokens=2))


def test_a_borrowed_engine_reads_and_writes_through_but_has_no_close(hosted):
    _, engine = hosted
    borrowed = BorrowedEngine(engine)
    borrowed.policy_version = 7
    borrowed.close()
    assert engine.policy_version == 7 and borrowed.shares_policy_weights and engine.closed == 0


def auth(server) -> dict:
    return {"Authorization": f"Bearer {server.api_key}"}
