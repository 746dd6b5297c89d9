"""Fixtures: a live `grpoflow serve` on the tiny model (tests/helpers/live_server.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from helpers import support  # noqa: E402
from helpers.live_server import start_server, tiny_service  # noqa: E402

from grpoflow.policy.tiny import save_tiny_checkpoint  # noqa: E402

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'][0] }}:{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
"""A chat template the character tokenizer can spell."""


@pytest.fixture(scope="module")
def live():
    """A server shared by a module's tests; tests that change its weights use their own. It renders
    templates sent in requests (besides the character tokenizer's own)."""
    server = start_server(tiny_service(trust_request_chat_template=True))
    yield server
    server.stop()


@pytest.fixture
def fresh():
    """A server of its own, for tests that change weights or pause generation."""
    server = start_server(tiny_service(trust_request_chat_template=True))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def serve_live():
    """Starts a live server for a given Service (stop it with `.stop()`)."""
    return start_server


@pytest.fixture(scope="session")
def make_service():
    """Builds a tiny-model service with the given ServeConfig settings."""
    return tiny_service


@pytest.fixture
def chat_template() -> str:
    return CHAT_TEMPLATE


@pytest.fixture
def client(live):
    with httpx.Client(base_url=live.url, timeout=60) as session:
        yield session


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """The tiny Qwen2 that vLLM's CPU attention takes (head_dim 64), saved as a user's checkpoint
    (seed 42): the model the vLLM server suites serve."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"), seed=42, **support.VLLM_TINY_SHAPE)
