"""--api-key: every endpoint but /health, /ping and /version needs the bearer token."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from grpoflow.server import build_app

KEY = "sesame"


@pytest.fixture(scope="module")
def guarded(make_service):
    with TestClient(build_app(make_service(api_key=KEY))) as client:
        yield client


def test_open_paths_need_no_key(guarded):
    assert guarded.get("/health").status_code == 200
    assert guarded.get("/ping").status_code == 200
    assert guarded.get("/version").status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/server_info"),
        ("POST", "/update_weights"),
        ("POST", "/collective_rpc"),
        ("POST", "/pause"),
    ],
)
def test_a_missing_or_wrong_key_is_refused(guarded, method, path, headers):
    answer = guarded.request(method, path, headers=headers, json={"prompt": [1], "max_tokens": 1})
    assert answer.status_code == 401
    assert "Authorization: Bearer KEY" in answer.json()["error"]["message"]


def test_the_right_key_is_served(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert guarded.get("/v1/models", headers=headers).json()["data"][0]["id"] == "tiny"
    answer = guarded.post("/v1/completions", headers=headers, json={"prompt": [1, 2], "max_tokens": 2})
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 1


def test_a_non_ascii_key_matches_its_utf8_bytes(make_service):
    key = "clé-секрет"
    with TestClient(build_app(make_service(api_key=key))) as client:
        raw = f"Bearer {key}".encode()
        assert client.get("/v1/models", headers=[(b"authorization", raw)]).status_code == 200
        wrong = f"Bearer {key[:-1]}x".encode()
        assert client.get("/v1/models", headers=[(b"authorization", wrong)]).status_code == 401
