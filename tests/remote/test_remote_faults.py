"""The trainer's side of server mode against a server that fails: a proxy in front of a real
`grpoflow serve` drops connections, answers 503 or HTML, drips, corrupts completions, or stays
down; every call ends by its deadline with an error naming the server and the call, retries what
is safe to retry, and a run stops with a checkpoint instead of crashing mid-step."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from helpers import support  # noqa: E402
from helpers.faulty_proxy import FaultyProxy  # noqa: E402
from helpers.live_server import start_server, tiny_service  # noqa: E402

from grpoflow.engines import SamplingParams  # noqa: E402
from grpoflow.remote.engine import RemoteEngine  # noqa: E402
from grpoflow.run.failures import RunStopped  # noqa: E402
from grpoflow.transport import ServerError  # noqa: E402
from grpoflow.transport.server_client import ServerClient  # noqa: E402

PARAMS = SamplingParams(n=2, max_tokens=4)


@pytest.fixture(scope="module")
def served():
    server = start_server(tiny_service())
    yield server
    server.stop()


@pytest.fixture
def proxy(served):
    faulty = FaultyProxy(served.url)
    yield faulty
    faulty.close()


def test_a_dripping_server_is_cut_off_at_the_calls_deadline(proxy):
    client = ServerClient([proxy.url])
    proxy.fail("/v1/models", "drip")
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"GET /v1/models did not complete within 2s"):
        client.request("GET", proxy.url, "/v1/models", timeout=2, retries=0)
    assert time.monotonic() - start < 3.0
    client.close()


def test_an_html_answer_is_an_error_naming_the_server_and_the_call(proxy):
    client = ServerClient([proxy.url])
    proxy.fail("/v1/models", "html", times=3)
    with pytest.raises(
        ServerError, match=rf"{proxy.url}: GET /v1/models answered with a body that is not JSON"
    ):
        client.request("GET", proxy.url, "/v1/models")
    client.close()


def test_dropped_connections_and_503s_are_retried(proxy):
    engine = RemoteEngine([proxy.url], startup_timeout=30, weight_transfer="checkpoint", vocab_size=None)
    try:
        proxy.fail("/v1/completions", "drop")
        proxy.fail("/v1/completions", "503")
        groups = engine.generate([[1, 2, 3]], PARAMS)
        assert len(groups) == 1 and len(groups[0]) == 2
        assert proxy.seen["/v1/completions"] == 3
        proxy.fail("/v1/completions", "503", times=None)  # down for good: retries run out
        with pytest.raises(ServerError, match="answered POST /v1/completions with HTTP 503"):
            engine.generate([[1, 2, 3]], PARAMS)
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("nan_logprobs", "log-probs that are not finite"),
        ("huge_token_ids", "token ids outside the policy's vocabulary"),
        ("no_choices", "without a list of indexed choices"),
    ],
)
def test_corrupt_completions_never_reach_training(proxy, served, fault, message):
    vocab = served.service.limits.vocab_size
    engine = RemoteEngine([proxy.url], startup_timeout=30, weight_transfer="checkpoint", vocab_size=vocab)
    try:
        proxy.fail("/v1/completions", fault)
        with pytest.raises(ServerError, match=message):
            engine.generate([[1, 2, 3]], PARAMS)
    finally:
        engine.close()


def test_the_api_key_comes_from_the_config_or_vllm_api_key(monkeypatch):
    keyed = start_server(tiny_service(api_key="sesame"))
    try:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        with pytest.raises(ServerError, match="HTTP 401"):
            RemoteEngine([keyed.url], startup_timeout=30)
        engine = RemoteEngine([keyed.url], startup_timeout=30, api_key="sesame")
        assert len(engine.generate([[1, 2]], PARAMS)[0]) == 2
        engine.close()
        monkeypatch.setenv("VLLM_API_KEY", "sesame")
        engine = RemoteEngine([keyed.url], startup_timeout=30)
        assert len(engine.generate([[1, 2]], PARAMS)[0]) == 2
        engine.close()
    finally:
        keyed.stop()


def _server_mode_trainer(tmp_path, proxy, **overrides):
    from grpoflow.run.build import build_trainer

    config = support.recipe(
        tmp_path,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=proxy.url,
        vllm_weight_transfer="checkpoint",
        weight_sync_check=False,
        max_steps=3,
        **overrides,
    )
    return build_trainer(config)


@pytest.mark.slow
def test_a_run_survives_a_failed_sync_and_stops_with_a_checkpoint_when_the_server_stays_down(tmp_path, proxy):
    trainer = _server_mode_trainer(tmp_path, proxy)
    try:
        proxy.fail("/collective_rpc", "503")  # the first sync fails once: retried
        trainer.step()
        proxy.fail("/collective_rpc", "503", times=None)
        with pytest.raises(
            RunStopped, match=r"stopped after step 2: the weight sync failed 3 time\(s\)"
        ) as stop:
            trainer.train()
        assert "checkpoint-2" in str(stop.value)
        assert (tmp_path / "run" / "checkpoint-2").is_dir()
        proxy.heal("/collective_rpc")
        proxy.fail("/v1/completions", "drop", times=None)
        with pytest.raises(RunStopped, match="stopped before step 3: the rollout server failed") as down:
            trainer.train()
        assert "checkpoint-2" in str(down.value)
    finally:
        trainer.engine.close()
