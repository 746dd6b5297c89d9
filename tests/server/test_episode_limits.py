"""Recorded episodes within bounds: caps on an episode's turns and bytes and on all episodes' bytes,
tools kept only where the chat template reads them, and episodes read back a page at a time."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from grpoflow.engines.base import Completion
from grpoflow.rollout.program_turns import Endpoint, take_episode
from grpoflow.server import build_app
from grpoflow.server.episode_recorder import RecordedTurn, TurnRequest
from grpoflow.server.episode_routes import MAX_TURNS_PAGE, PAGE_BYTES, episode_page

TEMPLATE = (
    "{% if tools %}t{% endif %}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
"""A chat template that reads `tools` (to mark that some are offered) without rendering them."""
TOOLLESS_TEMPLATE = TEMPLATE.replace("{% if tools %}t{% endif %}", "")
MiB = 2**20


def big_tools(nbytes: int) -> list[dict]:
    """Tool schemas of about `nbytes` bytes as JSON (100 tools with long descriptions)."""
    return [
        {"type": "function", "function": {"name": f"f{i}", "description": "x" * (nbytes // 100)}}
        for i in range(100)
    ]


def chat(client: TestClient, episode_id: str, content: str = "hi", **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}
    return client.post("/v1/chat/completions", json=body, headers={"X-Episode-Id": episode_id})


@pytest.fixture
def serve(make_service):
    """A started app on the tiny model with the given settings and TEMPLATE as its chat template."""
    clients = []

    def start(template: str = TEMPLATE, **settings) -> TestClient:
        service = make_service(**settings)
        service.tokenizer.chat_template = template
        clients.append(TestClient(build_app(service)).__enter__())
        return clients[-1]

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def test_a_150_turn_episode_of_3_mib_tools_per_turn_is_refused_at_the_byte_cap(serve):
    client = serve(max_episode_bytes=8 * MiB, max_recorded_bytes=16 * MiB)
    tools = big_tools(3 * MiB)
    answers = []
    for _ in range(150):
        answers.append(chat(client, "ep-big", tools=tools))
        if answers[-1].status_code != 200:
            break
    assert [answer.status_code for answer in answers] == [200, 200, 413]
    error = answers[-1].json()["error"]
    assert "--max-episode-bytes" in error["message"] and str(8 * MiB) in error["message"]
    assert error["param"] == "episode_id"
    assert client.get("/v1/episodes/ep-big").json()["num_turns"] == 2
    info = client.get("/server_info").json()["grpoflow"]["episodes"]
    assert 6 * MiB < info["num_bytes"] <= 8 * MiB and info["max_episode_bytes"] == 8 * MiB


def test_past_max_episode_turns_a_turn_is_refused_with_429(serve):
    client = serve(max_episode_turns=3)
    assert [chat(client, "ep-long").status_code for _ in range(3)] == [200, 200, 200]
    refused = chat(client, "ep-long")
    assert refused.status_code == 429 and "--max-episode-turns 3" in refused.json()["error"]["message"]
    assert chat(client, "ep-other").status_code == 200  # the cap is per episode


def test_past_max_recorded_bytes_the_least_recently_recorded_episodes_are_dropped(serve):
    client = serve(max_episode_bytes=3 * MiB, max_recorded_bytes=5 * MiB)
    for name in ("old", "mid", "new"):
        assert chat(client, f"ep-{name}", tools=big_tools(2 * MiB)).status_code == 200
    listed = [item["id"] for item in client.get("/v1/episodes").json()["data"]]
    assert listed == ["ep-mid", "ep-new"]
    assert client.get("/v1/episodes/ep-old").status_code == 404
    info = client.get("/server_info").json()["grpoflow"]["episodes"]
    assert info["num_bytes"] <= 5 * MiB and info["num_dropped"] == 1


def test_tools_are_kept_only_where_the_chat_template_reads_them(serve):
    tools = big_tools(10_000)
    for template, kept in ((TEMPLATE, tools), (TOOLLESS_TEMPLATE, None)):
        client = serve(template)
        assert chat(client, "ep-tools", tools=tools).status_code == 200
        assert client.get("/v1/episodes/ep-tools").json()["turns"][0]["tools"] == kept


def test_an_episode_and_the_list_are_read_a_page_at_a_time(serve):
    client = serve()
    for index in range(5):
        assert chat(client, "ep-paged", content=f"turn {index}").status_code == 200
    pages, offset = [], 0
    while offset is not None:
        page = client.get("/v1/episodes/ep-paged", params={"offset": offset, "limit": 2}).json()
        pages.append([turn["index"] for turn in page["turns"]])
        assert page["num_turns"] == 5 and page["offset"] == offset
        offset = page["next_offset"]
    assert pages == [[0, 1], [2, 3], [4]]
    whole = client.get("/v1/episodes/ep-paged").json()
    assert [turn["messages"][0]["content"] for turn in whole["turns"]] == [f"turn {i}" for i in range(5)]
    assert whole["next_offset"] is None
    for limit in (0, MAX_TURNS_PAGE + 1, "many"):
        refused = client.get("/v1/episodes/ep-paged", params={"limit": limit})
        assert refused.status_code == 400

    for name in ("b", "c"):
        chat(client, f"ep-{name}")
    listed = client.get("/v1/episodes", params={"offset": 1, "limit": 1}).json()
    assert listed["data"] == [{"id": "ep-b", "num_turns": 1}] and listed["has_more"] is True
    last = client.get("/v1/episodes", params={"offset": 2}).json()
    assert last["data"] == [{"id": "ep-c", "num_turns": 1}] and last["has_more"] is False


def test_a_page_of_turns_stops_near_page_bytes():
    messages = [{"role": "user", "content": "x" * (3 * MiB)}]
    request = TurnRequest("", "ep", json.dumps(messages).encode(), b"null", b"{}")
    completion = Completion([5, 6], [-0.5, -1.0], "stop", 0)
    response = {
        "id": "r",
        "created": 0,
        "choices": [{"finish_reason": "stop", "message": {"role": "assistant"}}],
    }
    turns = [RecordedTurn.of(request, [1, 2, 3], completion, response) for _ in range(10)]

    page = episode_page("ep", 10, 0, turns)
    parsed = json.loads(page)
    assert len(page) < PAGE_BYTES + 4 * MiB
    assert parsed["next_offset"] == len(parsed["turns"]) < 10
    assert parsed["turns"][0]["completion_ids"] == [5, 6] and parsed["turns"][0]["prompt_ids"] == [1, 2, 3]


def test_the_trainer_reads_every_page_of_an_episode_then_deletes_it(make_service, serve_live):
    server = serve_live(make_service())
    server.service.tokenizer.chat_template = TEMPLATE
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for index in range(5):
                assert chat(client, "ep-taken", content=f"turn {index}").status_code == 200

        async def take() -> list[dict]:
            async with httpx.AsyncClient(timeout=30) as fetcher:
                return await take_episode(
                    fetcher, Endpoint(server.url, "-", "tiny"), "ep-taken", page_turns=2
                )

        turns = asyncio.run(take())
        assert [turn["messages"][0]["content"] for turn in turns] == [f"turn {i}" for i in range(5)]
        assert httpx.get(f"{server.url}/v1/episodes/ep-taken").status_code == 404
    finally:
        server.stop()
