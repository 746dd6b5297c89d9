"""What grpoflow's RemoteEngine asks of a server: token ids, not per-token strings."""

from __future__ import annotations

from grpoflow.engines import SamplingParams
from grpoflow.engines.remote import RemoteEngine


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
