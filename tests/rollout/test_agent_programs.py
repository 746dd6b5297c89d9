"""Agent programs on the real `openai` client, against the policy's native engine hosted in this
process: the training sequences are exactly what was sampled plus the template's ids between turns;
failures, hangs and spent budgets end only their own episode, and a rewritten history starts
another sequence of it."""

from __future__ import annotations

import json
import math
import threading

import httpx
import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from helpers import agent_programs  # noqa: E402
from helpers.native_fixtures import forward_logprobs  # noqa: E402
from helpers.trained_turns import assert_every_turn_trained  # noqa: E402

from grpoflow import cli  # noqa: E402
from grpoflow.agents.config import AgentConfig  # noqa: E402
from grpoflow.cli import RECIPES  # noqa: E402
from grpoflow.data.prompts import PromptItem  # noqa: E402
from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpoflow.rollout.agent_programs import (  # noqa: E402
    PROGRAM_REWARD,
    AgentPrograms,
    load_agent_program,
    program_rewards,
)
from grpoflow.rollout.batch import collate  # noqa: E402
from grpoflow.rollout.groups import reward_inputs  # noqa: E402
from grpoflow.rollout.program_turns import new_episode_id  # noqa: E402
from grpoflow.run.build import run  # noqa: E402
from grpoflow.run.config import load_config  # noqa: E402
from grpoflow.run.evaluate_model import RESULTS_FILE  # noqa: E402
from grpoflow.server.episode_recorder import EPISODE_ID  # noqa: E402

TURN_TOKENS = 6


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = agent_programs.TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(len(tokenizer), model_type="llama", max_position_embeddings=512).eval()


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    options = EngineOptions(engine=EngineConfig(max_model_len=512, max_num_seqs=16))
    return build_engine("native", model, tokenizer, options)


def rollout(tokenizer, program: str, **options) -> AgentPrograms:
    config = AgentConfig(
        agent_program=f"helpers.agent_programs:{program}", max_turn_tokens=TURN_TOKENS, **options
    )
    return AgentPrograms(config, tokenizer, model_name="tiny", max_model_len=512)


def items(*rows: dict) -> list[PromptItem]:
    return [PromptItem(prompt=row["question"], prompt_ids=[5, 6], columns=row) for row in rows]


def params(count: int, n: int = 1, max_tokens: int = 200) -> list[SamplingParams]:
    return [SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=100 + i) for i in range(count)]


def test_a_tool_episode_trains_on_exactly_the_sampled_ids_and_the_templates_ids_between(
    engine, model, tokenizer
):
    agent = rollout(tokenizer, "tool_agent")
    try:
        (group,) = agent(engine, items({"id": "tool", "question": "What is 2 + 3?"}), params(1))
    finally:
        agent.close()
    seen = agent_programs.SEEN.pop("tool")
    (completion,) = group.completions
    assert len(seen) == 3 and agent.last_metrics["episodes/dropped_turns_mean"] == 0
    first, last = seen[0], seen[-1]
    assert group.item.prompt_ids == first["prompt_ids"]
    assert completion.token_ids == last["prompt_ids"][len(first["prompt_ids"]) :] + last["completion_ids"]
    sampled = torch.zeros(len(completion.token_ids), dtype=torch.long)
    for turn in seen:
        start = len(turn["prompt_ids"]) - len(first["prompt_ids"])
        assert (
            1 <= len(turn["completion_ids"]) <= TURN_TOKENS
        )  # the run's max_turn_tokens, not the program's 100
        assert completion.token_ids[start : start + len(turn["completion_ids"])] == turn["completion_ids"]
        sampled[start : start + len(turn["completion_ids"])] = 1
        torch.testing.assert_close(
            torch.tensor(completion.logprobs[start : start + len(turn["logprobs"])]),
            torch.tensor(turn["logprobs"]),
        )
        # temperature 1 (the run's), not the program's greedy 0: the model's own log-softmax
        torch.testing.assert_close(
            torch.tensor(turn["logprobs"]),
            torch.tensor(forward_logprobs(model, turn["prompt_ids"], turn["completion_ids"], 1.0)),
            atol=1e-4,
            rtol=1e-4,
        )
    assert completion.mask == sampled.tolist()
    assert all(value == 0.0 for value, bit in zip(completion.logprobs, completion.mask) if not bit)
    inserted = first["prompt_ids"] + first["completion_ids"]
    tool_ids = seen[1]["prompt_ids"][len(inserted) :]
    first_text = tokenizer.decode(first["completion_ids"], skip_special_tokens=True)
    if first["completion_ids"][-1] != tokenizer.eos_token_id:  # the template closes the turn after the call
        expected = f"<call>add {json.dumps(agent_programs.ARGUMENTS)}</call><eos>\nt:5\na:"
        assert tool_ids == tokenizer(expected, add_special_tokens=False)["input_ids"], first_text
    batch = collate([group], tokenizer.pad_token_id, torch.device("cpu"))
    assert batch.loss_mask[0, : len(completion.mask)].tolist() == completion.mask
    prompts, completions, _, columns = reward_inputs([group])
    ((name, reward),) = program_rewards()
    assert name == PROGRAM_REWARD and reward(completions, **columns) == [1.0]
    assert completions == [
        tokenizer.decode(last["completion_ids"], skip_special_tokens=True)
    ]  # the final answer
    assert agent.last_metrics["episodes/turns_mean"] == 3 and agent.last_metrics["episodes/errors"] == 0
    assert 0 < agent.last_metrics["episodes/masked_token_fraction"] < 1


def test_failures_hangs_and_rewritten_histories_end_only_their_own_episode(engine, tokenizer, caplog):
    rows = [
        {"id": name, "question": "hi", "behaviour": name}
        for name in ("ok", "raise", "hang", "rewrite", "none")
    ]
    agent = rollout(tokenizer, "dispatch", agent_timeout=2.0)
    try:
        groups = agent(engine, items(*rows), params(len(rows)))
    finally:
        agent.close()
    outcomes = {group.item.columns["id"]: group for group in groups}
    seen = {name: agent_programs.SEEN.pop(name, []) for name in outcomes}
    ok, raised, hung, rewritten, empty = (
        outcomes[name] for name in ("ok", "raise", "hang", "rewrite", "none")
    )
    assert ok.completions[0].finish_reason == "stop" and ok.environments[0].reward == 0.25
    assert ok.completions[0].token_ids == seen["ok"][0]["completion_ids"]
    for group, words in (
        (raised, "RuntimeError: the tool broke"),
        (hung, "agent_timeout=2"),
        (empty, "no chat"),
    ):
        (completion,) = group.completions
        assert completion.finish_reason == "error" and completion.token_ids == []
        assert words in group.environments[0].error and group.environments[0].reward is None
    assert "the tool broke" in caplog.text and "'behaviour': 'raise'" in caplog.text  # logged with its row
    # turn 2 restarted the conversation: turn 1 is a sequence, turns 2 and 3 another, all trained
    (completion,) = rewritten.completions
    first, second, third = seen["rewrite"]
    assert rewritten.item.prompt_ids == first["prompt_ids"] and rewritten.sequence_starts == [
        [len(first["completion_ids"])]
    ]
    assert completion.token_ids == first["completion_ids"] + third["prompt_ids"] + third["completion_ids"]
    batch = collate([rewritten], tokenizer.pad_token_id, torch.device("cpu"))
    assert_every_turn_trained(batch, 0, seen["rewrite"])
    assert (rewritten.environments[0].num_dropped, rewritten.environments[0].num_segments) == (0, 2)
    metrics = agent.last_metrics
    assert metrics["episodes/dropped_turns_mean"] == 0
    assert metrics["episodes/segments_mean"] == pytest.approx((1 + 2) / 5)  # ok 1, rewrite 2, failed 0
    assert metrics["episodes/ended_by/timeout"] == pytest.approx(1 / 5)
    assert metrics["episodes/ended_by/error"] == pytest.approx(2 / 5)
    assert metrics["episodes/errors"] == pytest.approx(3 / 5) and metrics["time/agent"] < 30
    assert "recorded turns were dropped" not in caplog.text


def test_a_plain_function_runs_in_a_thread_and_a_spent_budget_ends_the_episode_truncated(engine, tokenizer):
    agent = rollout(tokenizer, "endless_sync_agent")
    budget = 40
    try:
        (group,) = agent(
            engine, items({"id": "sync", "question": "tell me"}), params(1, n=2, max_tokens=budget)
        )
    finally:
        agent.close()
    assert len(group.completions) == 2
    for completion, outcome in zip(group.completions, group.environments):
        assert outcome.ending in ("budget", "length") and outcome.error is None and outcome.reward is None
        assert completion.finish_reason == "length" and len(completion.token_ids) == budget
        assert outcome.num_turns >= 2 and outcome.num_dropped == 0
    assert (
        agent.last_metrics["episodes/ended_by/budget"] + agent.last_metrics["episodes/ended_by/length"] == 1
    )


def test_hanging_plain_functions_hold_no_more_threads_than_agent_concurrency(engine, tokenizer):
    """A plain function that hangs past agent_timeout keeps its thread; later episodes wait for one of
    agent_concurrency threads (and time out there) instead of starting threads of their own."""
    agent_programs.RELEASE.clear()
    agent = rollout(tokenizer, "hanging_sync_agent", agent_concurrency=2, agent_timeout=0.2)
    rows = [{"id": f"hang-{index}", "question": "hi"} for index in range(4)]
    before, counts = threading.active_count(), []
    try:
        for _ in range(3):
            groups = agent(engine, items(*rows), params(len(rows)))
            assert all(group.environments[0].ending == "timeout" for group in groups)
            counts.append(threading.active_count() - before)
    finally:
        agent_programs.RELEASE.set()
        agent.close()
    # two workers and the hosted server's thread, and no more after three rounds than after one
    assert max(counts) <= 2 + 1 and counts[-1] <= counts[0], counts


def test_the_hosted_server_serves_only_while_the_programs_run(engine, tokenizer):
    agent = rollout(tokenizer, "dispatch")
    try:
        agent(engine, items({"id": "gate", "question": "hi", "behaviour": "ok"}), params(1))
        hosted = agent.hosted
        assert hosted is not None and not hosted.is_open
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        headers = {"Authorization": f"Bearer {hosted.api_key}"}
        with pytest.raises(httpx.ReadTimeout):  # closed between rollouts: the trainer has the engine
            httpx.post(f"{hosted.url}/v1/chat/completions", json=body, headers=headers, timeout=1.0)
        agent(engine, items({"id": "gate", "question": "hi", "behaviour": "ok"}), params(1))
        assert agent.hosted is hosted  # one server for the run
    finally:
        agent.close()
    agent_programs.SEEN.pop("gate")
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # the engine outlives its server


def test_bad_programs_are_explained(tmp_path):
    path = tmp_path / "programs.py"
    path.write_text("def two(client, model):\n    return 1\n\nVALUE = 3\n")
    with pytest.raises(ValueError, match=r"must take three arguments, \(client, model, row\)"):
        load_agent_program(f"{path}:two")
    with pytest.raises(ValueError, match="is a int, not a function"):
        load_agent_program(f"{path}:VALUE")


@pytest.mark.slow
def test_a_run_trains_on_an_agent_programs_episodes_and_grpoflow_eval_plays_them_too(tmp_path, capsys):
    values = {"output_dir": str(tmp_path / "run"), "report_to": ["none"], "disable_tqdm": True}
    values |= {"per_device_train_batch_size": 16, "max_steps": 3, "log_completions": True}
    history = run(load_config(RECIPES / "relay-agent.yaml", values))
    step = history[-1]
    assert step["episodes/turns_mean"] == 3 and step["episodes/errors"] == 0
    assert 0.5 < step["episodes/masked_token_fraction"] < 0.9 and step["time/agent"] > 0
    assert 0 <= step["rewards/agent_program/mean"] <= 1 and math.isfinite(step["loss"])
    row = json.loads((tmp_path / "run" / "completions.jsonl").read_text().splitlines()[0])
    assert set(row["rewards"]) == {PROGRAM_REWARD}
    output = tmp_path / "eval"
    flags = ["--config", "relay-agent", "--eval_dataset", "relay#4", "--num_generations_eval", "2"]
    assert cli.main(["eval", *flags, "--output_dir", str(output), "--report_to", "none"]) == 0
    metrics = json.loads((output / RESULTS_FILE).read_text())["metrics"]
    assert metrics["eval/num_prompts"] == 4 and "eval/rewards/agent_program/mean" in metrics


@pytest.mark.slow
def test_with_rollout_servers_the_programs_sample_from_them_and_their_episodes_are_taken(
    tokenizer, model, tmp_path
):
    from grpoflow.remote.engine import RemoteEngine
    from grpoflow.run.infer_workers import RolloutServers

    tokenizer.save_pretrained(tmp_path / "model")
    model.save_pretrained(tmp_path / "model")
    with RolloutServers(["--model", str(tmp_path / "model")], [None], tmp_path / "logs") as servers:
        servers.wait_until_healthy(120)
        engine = RemoteEngine(servers.urls)
        agent = rollout(tokenizer, "dispatch")
        try:
            (group,) = agent(
                engine, items({"id": "remote", "question": "hi", "behaviour": "ok"}), params(1, n=2)
            )
        finally:
            agent.close()
            engine.close()
        assert agent.hosted is None  # nothing hosted: the servers record the episodes
        seen = agent_programs.SEEN.pop("remote")
        assert sorted(c.token_ids for c in group.completions) == sorted(
            turn["completion_ids"] for turn in seen
        )
        assert [outcome.reward for outcome in group.environments] == [0.25, 0.25]
        assert httpx.get(f"{servers.urls[0]}/v1/episodes", timeout=10).json()["data"] == []  # taken


def test_episode_ids_are_random_not_sequential():
    ids = [new_episode_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(
        EPISODE_ID.fullmatch(episode_id) and len(episode_id) == len("agent-") + 22 for episode_id in ids
    )
    assert len({episode_id[:10] for episode_id in ids}) > 900  # no shared run prefix or counter
