"""Real clients drive `grpoflow serve`: TRL's VLLMClient, and grpoflow's trainer in vllm_mode server."""

from __future__ import annotations

import pytest
import torch
from helpers import support

from grpoflow.run.build import build_trainer, run


@pytest.fixture
def trl_client(live, monkeypatch):
    pytest.importorskip("requests")
    trl_vllm = pytest.importorskip("trl.generation.vllm_client")
    if not trl_vllm.is_vllm_available():
        # The client checks that vLLM is installed, though it needs vLLM only for NCCL transfers.
        monkeypatch.setattr(trl_vllm, "is_vllm_available", lambda *args, **kwargs: True)
    return trl_vllm.VLLMClient(base_url=live.url, connection_timeout=30)


def test_trls_vllm_client_generates_and_chats(trl_client, live, chat_template):
    tokenizer = live.service.tokenizer
    assert trl_client.model == "tiny"
    assert trl_client.get_world_size() == 1
    assert trl_client.get_server_info()["model_config"]["max_model_len"] == 512

    out = trl_client.generate(["ab", "cde"], n=3, max_tokens=5, temperature=0.9)
    assert out["prompt_ids"] == [tokenizer("ab")["input_ids"], tokenizer("cde")["input_ids"]]
    assert len(out["completion_ids"]) == 6
    for ids, logprobs, logprob_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        assert 1 <= len(ids) <= 5
        assert logprob_ids == [[token] for token in ids]
        assert all(len(values) == 1 and values[0] < 0 for values in logprobs)

    seeded = trl_client.generate([[5, 6, 7]], n=2, max_tokens=4, generation_kwargs={"seed": 3})
    again = trl_client.generate([[5, 6, 7]], n=2, max_tokens=4, generation_kwargs={"seed": 3})
    assert seeded["prompt_ids"] == [[5, 6, 7]] and seeded["completion_ids"] == again["completion_ids"]

    chat = trl_client.chat(
        [[{"role": "user", "content": "hi"}]], n=2, max_tokens=3, chat_template=chat_template
    )
    assert chat["prompt_ids"] == [tokenizer("u:hi\na:", add_special_tokens=False)["input_ids"]]
    assert len(chat["completion_ids"]) == 2
    assert [len(values) for values in chat["logprobs"]] == [len(ids) for ids in chat["completion_ids"]]

    trl_client.reset_prefix_cache()
    with trl_client.weight_update():  # /start_weight_update and /finish_weight_update
        pass
    with pytest.raises((RuntimeError, NotImplementedError)):  # its NCCL transport cannot run here
        trl_client.init_communicator(device="cpu")


def test_the_trainer_runs_against_the_server(fresh, tmp_path):
    config = support.recipe(
        tmp_path, max_steps=2, use_vllm=True, vllm_mode="server", vllm_server_base_url=fresh.url
    )
    trainer = build_trainer(config)
    try:
        history = run(config, trainer)
    finally:
        trainer.engine.close()
    assert len(history) == 2
    # The post-sync check ran against the server and found the trained weights there.
    assert all(step["sync/check_logprob_gap"] < 1e-3 for step in history)
    assert all(step["completions/mean_length"] > 0 for step in history)
    assert fresh.service.weight_version == "2"
    served = dict(fresh.service.model.named_parameters())
    for name, parameter in trainer.model.named_parameters():
        assert torch.equal(served[name], parameter.detach()), name
