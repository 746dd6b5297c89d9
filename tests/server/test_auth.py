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


TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}a:"


@pytest.fixture(scope="module")
def two_keys(make_service, tmp_path_factory):
    """A server taking --api-key 'first' and --api-key-file's 'second' and 'third'."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("second\n\n  third  \n")
    service = make_service(api_key="first", api_key_file=str(key_file))
    service.tokenizer.chat_template = TEMPLATE
    with TestClient(build_app(service)) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_key_of_the_key_file_and_the_flag_is_served(two_keys):
    for key in ("first", "second", "third"):
        assert two_keys.get("/v1/models", headers=bearer(key)).status_code == 200
    assert two_keys.get("/v1/models", headers=bearer("fourth")).status_code == 401


def test_with_several_keys_an_episode_is_visible_only_to_the_key_that_opened_it(two_keys):
    def chat(key: str) -> int:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        headers = {**bearer(key), "X-Episode-Id": "ep-shared"}
        return two_keys.post("/v1/chat/completions", json=body, headers=headers).status_code

    assert chat("first") == 200
    never = two_keys.get("/v1/episodes/ep-never", headers=bearer("second")).json()
    for method in ("GET", "DELETE"):
        answer = two_keys.request(method, "/v1/episodes/ep-shared", headers=bearer("second"))
        assert answer.status_code == 404
        assert answer.json()["error"]["message"] == never["error"]["message"].replace("ep-never", "ep-shared")
    assert two_keys.get("/v1/episodes", headers=bearer("second")).json()["data"] == []

    assert chat("second") == 200  # its own episode of that id, not a turn of the first key's
    assert chat("first") == 200
    turns = {
        key: two_keys.get("/v1/episodes/ep-shared", headers=bearer(key)).json()["num_turns"]
        for key in ("first", "second")
    }
    assert turns == {"first": 2, "second": 1}
    assert two_keys.delete("/v1/episodes/ep-shared", headers=bearer("second")).status_code == 200
    assert two_keys.get("/v1/episodes", headers=bearer("first")).json()["data"] == [
        {"id": "ep-shared", "num_turns": 2}
    ]


@pytest.mark.parametrize(
    ("contents", "words"), [(None, "--api-key-file must be a file"), ("\n \n", "holds no key")]
)
def test_a_missing_or_empty_key_file_is_refused(make_service, tmp_path, contents, words):
    key_file = tmp_path / "keys.txt"
    if contents is not None:
        key_file.write_text(contents)
    with pytest.raises(ValueError, match=words):
        build_app(make_service(api_key_file=str(key_file)))
