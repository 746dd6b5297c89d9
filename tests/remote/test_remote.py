"""RemoteEngine against `grpoflow serve`: the requests it sends, the checkpoint transport (a server
in a thread of this process, whose model the tests read) and the collective transport (gloo, a
server in a process of its own). vLLM's own server: test_remote_vllm.py."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from helpers import support  # noqa: E402
from helpers.live_server import start_server, tiny_service  # noqa: E402

from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model  # noqa: E402
from grpoflow.remote import capabilities  # noqa: E402
from grpoflow.remote.engine import RemoteEngine  # noqa: E402
from grpoflow.transport import WeightSyncError  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [20, 21], [30, 31, 32]]
GREEDY = SamplingParams(n=1, max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def live():
    """A server of its own in this process, for tests that read or patch its service."""
    server = start_server(tiny_service())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with support.serve_in_subprocess(tmp_path_factory.mktemp("server")) as served:
        yield served


@pytest.fixture(scope="module")
def engine(url):
    """A RemoteEngine on the collective transport."""
    engine = RemoteEngine([url], startup_timeout=60, weight_transfer="collective", weight_sync_timeout=60)
    yield engine
    engine.close()


def model(seed: int) -> torch.nn.Module:
    """The served `tiny` model's shape with the weights of `seed` (the server's are seed 42)."""
    return build_preset_model("tiny", len(build_char_tokenizer()), seed=seed).eval()


def weights_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in module.named_parameters()}


def local_greedy(
    policy: torch.nn.Module, prompts: list[list[int]] = PROMPTS
) -> list[tuple[list[int], list[float]]]:
    """What the server's engine generates with `policy`'s weights, computed here."""
    local = build_engine(
        "native", policy, build_char_tokenizer(), EngineOptions(engine=EngineConfig(max_model_len=128))
    )
    return [(c.token_ids, c.logprobs) for group in local.generate(prompts, GREEDY) for c in group]


def served_greedy(engine: RemoteEngine) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for group in engine.generate(PROMPTS, GREEDY) for c in group]


def assert_same(got, want) -> None:
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, got_logprobs), (_, want_logprobs) in zip(got, want):
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)


# -- requests and the checkpoint transport ---------------------------------------------------


def test_the_remote_engine_never_has_the_server_decode_single_tokens(live, monkeypatch):
    tokenizer = live.service.tokenizer
    decode, lengths = tokenizer.decode, []

    def counting_decode(ids, **kwargs):
        lengths.append(len(ids))
        return decode(ids, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", counting_decode)
    engine = RemoteEngine([live.url], weight_transfer="checkpoint")
    try:
        groups = engine.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=8, ignore_eos=True))
    finally:
        engine.close()
    assert [len(c.token_ids) for c in groups[0]] == [8, 8]
    assert all(len(c.logprobs) == 8 for c in groups[0])
    assert 1 not in lengths  # token strings would cost one decode per generated token


def test_remote_engine_generates_and_reloads_weights(live, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about log-prob mode or a missing reload method
        engine = RemoteEngine([live.url], startup_timeout=30, sync_dir=tmp_path)
    try:
        assert engine.reload_methods == ["grpoflow_reload_weights"]
        params = SamplingParams(n=2, max_tokens=6, seed=5, ignore_eos=True)
        before = engine.generate([[3, 4, 5], [6, 7]], params)
        assert [len(group) for group in before] == [2, 2]
        assert all(len(completion.token_ids) == 6 == len(completion.logprobs) for completion in before[0])
        new = weights_of(build_preset_model("tiny", live.service.limits.vocab_size, seed=7))
        engine.update_weights(new.items(), version=3)
        served = weights_of(live.service.model)
        for name, tensor in new.items():
            assert torch.equal(served[name], tensor), name
        after = engine.generate([[3, 4, 5], [6, 7]], params)
        assert [c.token_ids for g in after for c in g] != [c.token_ids for g in before for c in g]
        assert after[0][0].policy_version == 3
        assert httpx.get(live.url + "/weight_info").json() == {"weight_version": "3"}
    finally:
        engine.close()


# -- the collective transport -----------------------------------------------------------------


def test_an_update_makes_the_server_generate_as_the_updated_model(engine, url):
    assert engine.weight_transfer == "collective"
    assert_same(served_greedy(engine), local_greedy(model(42)))
    updated = model(7)
    engine.update_weights(updated.named_parameters(), version=1)
    got = served_greedy(engine)
    assert_same(got, local_greedy(updated))
    before = local_greedy(model(42))
    assert all(abs(g[0] - b[0]) > 1e-3 for (_, g), (_, b) in zip(got, before))  # the weights changed
    assert httpx.get(url + "/weight_info").json() == {"weight_version": "1"}
    assert engine.generate(PROMPTS[:1], GREEDY)[0][0].policy_version == 1


def test_an_update_drops_the_prefix_cache_the_old_weights_filled(engine):
    """A prompt whose full KV blocks the old weights cached is answered from the new weights: the
    collective update writes the served parameters in place, and no cached block outlives them."""
    long_prompt = [[3 + (7 * i) % 37 for i in range(72)]]  # two full blocks of 32 tokens, then 8
    engine.update_weights(model(42).named_parameters(), version=20)
    engine.generate(long_prompt, GREEDY)  # the server caches the prompt's blocks
    updated = model(7)
    engine.update_weights(updated.named_parameters(), version=21)
    got = [(c.token_ids, c.logprobs) for group in engine.generate(long_prompt, GREEDY) for c in group]
    assert_same(got, local_greedy(updated, long_prompt))


def test_a_wrong_shape_or_name_is_refused_and_changes_nothing(engine):
    before = served_greedy(engine)
    weights = dict(model(11).named_parameters())
    wrong_shape = {**weights, "model.norm.weight": torch.ones(3)}
    with pytest.raises(
        WeightSyncError, match=r"version 2: (server\(s\) http://127\.0\.0\.1:\d+ refused it|.*HTTP 400)"
    ):
        engine.update_weights(wrong_shape.items(), version=2)
    unknown = {**weights, "model.no_such.weight": torch.ones(3)}
    with pytest.raises(WeightSyncError, match=r"HTTP 400.*no parameter named 'model\.no_such\.weight'"):
        engine.update_weights(unknown.items(), version=2)
    assert served_greedy(engine) == before  # nothing was received
    second = model(13)
    engine.update_weights(second.named_parameters(), version=3)  # the same group goes on
    assert_same(served_greedy(engine), local_greedy(second))


def test_small_buckets_and_a_new_group_after_a_failure(url):
    engine = RemoteEngine([url], startup_timeout=60, weight_transfer="collective", bucket_bytes=4096)
    try:
        updated = model(17)
        engine.update_weights(updated.named_parameters(), version=4)  # replaces the fixture's group
        assert engine.transport.group is not None and len(engine.transport.group.process_group.name()) > 0
        assert_same(served_greedy(engine), local_greedy(updated))
        engine.transport.group.close()  # as after a failed broadcast: the next update builds a new group
        engine.update_weights(model(19).named_parameters(), version=5)
        assert_same(served_greedy(engine), local_greedy(model(19)))
    finally:
        engine.close()


def test_collective_needs_grpoflow_servers_and_auto_falls_back(url, monkeypatch):
    monkeypatch.setattr(capabilities, "server_info", lambda client, url: None)  # as a plain vLLM server
    with pytest.raises(ValueError, match="offer no collective weight transfer"):
        RemoteEngine([url], startup_timeout=30, weight_transfer="collective")
    engine = RemoteEngine([url], startup_timeout=30)
    try:
        assert engine.weight_transfer == "checkpoint"
    finally:
        engine.close()


@pytest.mark.slow
def test_the_trainer_syncs_over_the_collective_transport(tmp_path):
    from grpoflow.run.build import build_trainer

    with support.serve_in_subprocess(tmp_path) as url:
        config = support.recipe(
            tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, max_steps=2
        )
        trainer = build_trainer(config)
        try:
            assert trainer.engine.weight_transfer == "collective"  # auto, on a grpoflow server
            history = trainer.train()
            assert len(history) == 2 and trainer.engine.policy_version == 2
            assert all(0 <= step["sync/check_logprob_gap"] < 1e-3 for step in history)
            trainer.model.eval()
            assert_same(served_greedy(trainer.engine), local_greedy(trainer.model))
        finally:
            trainer.engine.close()


@pytest.mark.slow
def test_weight_sync_interval_skips_syncs(tmp_path):
    from grpoflow.run.build import build_trainer

    with support.serve_in_subprocess(tmp_path) as url:
        config = support.recipe(
            tmp_path,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=url,
            vllm_weight_transfer="collective",
            weight_sync_interval=2,
            max_steps=3,
        )
        trainer = build_trainer(config)
        versions = []
        send = trainer.engine.update_weights
        trainer.engine.update_weights = lambda weights, version: (
            versions.append(version),
            send(weights, version),
        )
        try:
            history = trainer.train()
            assert versions == [2]  # steps 1 and 3 skip the sync
            assert ["sync/check_logprob_gap" in step for step in history] == [False, True, False]
            assert httpx.get(url + "/weight_info").json() == {"weight_version": "2"}
        finally:
            trainer.engine.close()
