"""`/generate`, vLLM's demo endpoint in the shape Atropos's VLLMServer reads, on a live tiny server."""

from __future__ import annotations

import asyncio

import pytest
import torch


def test_generate_answers_token_ids_and_sampled_logprobs(client, live):
    prompt, temperature = [10, 11, 12, 13], 0.7
    body = {
        "prompt": {"prompt_token_ids": prompt},
        "logprobs": 0,
        "n": 3,
        "max_tokens": 5,
        "temperature": temperature,
        "ignore_eos": True,
    }
    answer = client.post("/generate", json=body).json()
    assert answer["prompt_token_ids"] == prompt
    assert answer["prompt"] == live.service.tokenizer.decode(prompt)
    assert answer["finish_reasons"] == ["length"] * 3
    for text, token_ids, entries in zip(answer["text"], answer["token_ids"], answer["logprobs"]):
        assert len(token_ids) == len(entries) == 5
        assert [int(next(iter(entry[0]))) for entry in entries] == token_ids
        assert text == live.service.tokenizer.decode(token_ids, skip_special_tokens=True)
        with torch.no_grad():
            logits = live.service.model(torch.tensor([prompt + token_ids])).logits[0, len(prompt) - 1 : -1]
        expected = (logits.float() / temperature).log_softmax(-1).gather(1, torch.tensor(token_ids)[:, None])
        got = torch.tensor([next(iter(entry[0].values())) for entry in entries])
        torch.testing.assert_close(got, expected[:, 0], atol=1e-4, rtol=1e-4)

    plain = client.post("/generate", json={"prompt": "abc", "max_tokens": 2}).json()
    assert set(plain) == {"text", "prompt", "finish_reasons"} and plain["prompt"] == "abc"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"prompt": {"prompt_token_ids": [1, 2]}, "logprobs": 2}, "logprobs=0"),
        ({"prompt": {"token_ids": [1, 2]}}, '{"prompt_token_ids": [int, ...]}'),
        ({"prompt": {"prompt_token_ids": [1, 2]}, "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt": {"prompt_token_ids": [1, 2]}, "stream": True}, "stream"),
        ({"prompt": {"prompt_token_ids": [1, 2]}, "max_tokens": 600}, "context of 512"),
    ],
)
def test_bad_generate_requests_name_the_problem(client, body, words):
    answer = client.post("/generate", json=body)
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]["message"]


def test_atropos_managed_server_samples_through_generate(live, tmp_path):
    """atroposlib's ManagedServer over its VLLMServer (what Atropos environments train from)."""
    pytest.importorskip("atroposlib")
    from atroposlib.envs.server_handling.managed_server import ManagedServer
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.vllm_server import VLLMServer

    live.service.tokenizer.save_pretrained(tmp_path)
    config = APIServerConfig(
        base_url=f"{live.url}/v1",
        model_name="tiny",
        tokenizer_name=str(tmp_path),
        server_type="vllm",
        api_key="x",
    )

    async def sample() -> list:
        managed = ManagedServer(VLLMServer(config), tokenizer=live.service.tokenizer)
        completion = await managed.completion(prompt="Say a: ", n=3, max_tokens=6, temperature=1.0)
        assert len(completion.choices) == 3
        return managed.get_state()["nodes"]

    prompt = live.service.tokenizer("Say a: ")["input_ids"]
    nodes = asyncio.run(sample())
    assert len(nodes) == 3
    for node in nodes:
        completion = node.tokens[len(prompt) :]
        assert node.tokens[: len(prompt)] == prompt and 1 <= len(completion) <= 6
        assert node.masked_tokens == [-100] * len(prompt) + completion
        assert node.logprobs[: len(prompt)] == [1.0] * len(prompt)
        assert all(value < 0 for value in node.logprobs[len(prompt) :])
