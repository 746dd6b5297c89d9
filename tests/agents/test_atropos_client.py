"""grpoflow as an Atropos trainer: AtroposClient against atroposlib's own trajectory API (`run-api`),
fed by an atroposlib environment that samples from `grpoflow serve`."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest

pytest.importorskip("atroposlib")
httpx = pytest.importorskip("httpx")

from helpers.atropos_api import letter_environment, trajectory_api  # noqa: E402
from helpers.atropos_env import GROUP_SIZE, LETTERS, MAX_TOKENS, PROMPT, letter_score  # noqa: E402

from grpoflow.agents.atropos_client import AtroposClient, AtroposConfig, groups_from_batch  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer  # noqa: E402
from grpoflow.run.infer_workers import RolloutServers, free_port  # noqa: E402

LOGGER = "grpoflow.agents.atropos_client"


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[str]:
    """One trajectory API for the tests that reset it before use."""
    with trajectory_api(tmp_path_factory.mktemp("atropos-api")) as url:
        yield url


def fresh(api: str, **overrides) -> AtroposConfig:
    """A config for `api` after emptying its queue and forgetting its registration."""
    httpx.get(f"{api}/reset_data", timeout=10).raise_for_status()
    return AtroposConfig(atropos_url=api, atropos_poll_seconds=0.05, **overrides)


def post_group(api: str, group: dict) -> None:
    httpx.post(f"{api}/scored_data", json=group, timeout=10).raise_for_status()


# -- end to end -------------------------------------------------------------------------------


@pytest.mark.slow
def test_batches_from_an_atropos_environment_sampling_grpoflow_serve(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    with trajectory_api(tmp_path) as api, RolloutServers(["--model", "tiny"], [None], tmp_path) as servers:
        tokenizer_dir, log = tmp_path / "tokenizer", tmp_path / "env.log"
        with letter_environment(api, servers.urls[0], tokenizer_dir, log):
            servers.wait_until_healthy(120)
            config = AtroposConfig(
                atropos_url=api,
                atropos_batch_size=2 * GROUP_SIZE,
                atropos_poll_seconds=0.1,
                atropos_max_wait_seconds=60,
            )
            with AtroposClient(config) as client:
                with pytest.raises(ValueError, match="call register"):
                    client.poll_batch()
                client.register(num_steps=10)
                batches = [client.next_batch() for _ in range(2)]
                assert client.status()["current_step"] >= 2
    prompts = {tuple(tokenizer(PROMPT.format(letter=letter))["input_ids"]): letter for letter in LETTERS}
    for batch in batches:
        assert sum(len(group.token_ids) for group in batch) == 2 * GROUP_SIZE
        for group in batch:
            assert group.env_id == 0
            assert group.overrides is None
            rows = zip(group.token_ids, group.loss_mask, group.logprobs, group.prompt_length, group.scores)
            for tokens, mask, logprobs, prompt_length, score in rows:
                assert len(tokens) == len(mask) == len(logprobs)
                letter = prompts[tuple(tokens[:prompt_length])]
                assert 1 <= len(tokens) - prompt_length <= MAX_TOKENS
                assert mask == [0] * prompt_length + [1] * (len(tokens) - prompt_length)
                assert logprobs[:prompt_length] == [1.0] * prompt_length
                assert all(value <= 0 for value in logprobs[prompt_length:])
                completion = tokenizer.decode(tokens[prompt_length:], skip_special_tokens=True)
                assert score == letter_score(completion, letter)


# -- converting groups ------------------------------------------------------------------------


def test_an_atropos_group_becomes_a_scored_group():
    prompt_then_completion = {
        "tokens": [[5, 6, 7, 8], [5, 6, 9]],
        "masks": [[-100, -100, 7, 8], [-100, -100, 9]],
        "scores": [1.0, 0],
        "inference_logprobs": [[1.0, 1.0, -0.5, -0.25], [1.0, 1.0, -2.0]],
        "overrides": [{"set_advantage_to_zero": True}, {}],
        "env_id": 3,
    }
    two_turns = {"tokens": [[1, 2, 3, 4, 5, 6]], "masks": [[-100, 2, 3, -100, -100, 6]], "scores": [0.5]}
    first, second = groups_from_batch([prompt_then_completion, two_turns])
    assert first.token_ids == [[5, 6, 7, 8], [5, 6, 9]]
    assert first.loss_mask == [[0, 0, 1, 1], [0, 0, 1]]
    assert first.prompt_length == [2, 2]
    assert first.scores == [1.0, 0.0] and isinstance(first.scores[1], float)
    assert first.logprobs == [[1.0, 1.0, -0.5, -0.25], [1.0, 1.0, -2.0]]
    assert first.overrides == [{"set_advantage_to_zero": True}, {}]
    assert first.env_id == 3
    assert second.loss_mask == [[0, 1, 1, 0, 0, 1]]
    assert second.prompt_length == [1]
    assert second.logprobs is None and second.overrides is None and second.env_id is None


GOOD_ROW = {
    "tokens": [1, 2, 3],
    "masks": [-100, 2, 3],
    "scores": 1.0,
    "inference_logprobs": [1.0, -1.0, -2.0],
}
"""A row the trainer takes: a prompt token, two trained ones, their log-probs."""


def test_malformed_rows_and_groups_are_skipped_with_the_reason(caplog):
    good = dict(GOOD_ROW)
    rows = [
        good,
        {**good, "masks": [-100, 2]},
        {**good, "masks": [-100, -100, -100]},
        {**good, "inference_logprobs": [-1.0]},
        {**good, "scores": float("nan")},
        {**good, "tokens": [1, "x", 3]},
    ]
    group = {key: [row[key] for row in rows] for key in good}
    unpaired = {"tokens": [[1, 2]] * 2, "masks": [[-100, 2]] * 2, "scores": [1.0]}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        (kept,) = groups_from_batch([group, unpaired, "not a group", {"tokens": [[1]]}])
    assert kept.token_ids == [[1, 2, 3]] and kept.scores == [1.0]
    reasons = "\n".join(caplog.messages)
    for words in (
        "row 1 of batch group 0 (env None): it has 3 tokens but 2 mask values",
        "row 2 of batch group 0 (env None): every mask value is -100",
        "row 3 of batch group 0 (env None): it has 3 tokens but 1 inference_logprobs",
        "row 4 of batch group 0 (env None): its score nan is not a finite number",
        "row 5 of batch group 0 (env None): its tokens are not a list of token ids",
        "skipped batch group 1 (env None): its lists pair no rows, having 2 tokens, 2 masks, 1 scores",
        "skipped batch group 2: it needs lists 'tokens', 'masks' and 'scores'",
        "skipped batch group 3: it needs lists",
    ):
        assert words in reasons


def test_rows_with_bad_log_probs_or_token_ids_are_skipped_not_trained_or_raised(caplog):
    """A log-prob that is not a number once raised mid-run, a NaN one trained silently and a token
    id past the vocabulary raised an IndexError in the update: each row is skipped with its reason."""
    good = dict(GOOD_ROW)
    rows = [
        good,
        {**good, "inference_logprobs": [1.0, "abc", -2.0]},
        {**good, "inference_logprobs": [1.0, float("nan"), -2.0]},
        {**good, "inference_logprobs": [1.0, True, -2.0]},
        {**good, "tokens": [1, 2, 999]},
        {**good, "tokens": [1, -2, 3]},
        {**good, "inference_logprobs": [float("nan"), -1.0, -2.0]},  # NaN on an untrained token: kept
    ]
    group = {key: [row[key] for row in rows] for key in good}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        (kept,) = groups_from_batch([group], vocab_size=100)
    assert kept.token_ids == [[1, 2, 3], [1, 2, 3]]
    reasons = "\n".join(caplog.messages)
    for words in (
        "row 1 of batch group 0 (env None): its inference_logprobs hold 'abc', not a number",
        "row 2 of batch group 0 (env None): a trained token's inference_logprob is nan",
        "row 3 of batch group 0 (env None): its inference_logprobs hold True, not a number",
        "row 4 of batch group 0 (env None): its token id 999 is outside the vocabulary (0..100)",
        "row 5 of batch group 0 (env None): its token id -2 is outside the vocabulary",
    ):
        assert words in reasons


def test_rows_the_api_accepts_but_cannot_be_trained_are_skipped_in_a_batch(api, caplog):
    config = fresh(api, atropos_batch_size=4, atropos_max_wait_seconds=10)
    uneven = {
        "tokens": [[1, 2, 3], [1, 2, 4], [1, 2, 5], [1, 2, 6]],
        "masks": [[-100, 2, 3], [-100, 2], [-100, -100, -100], [-100, 2, 6]],
        "scores": [0.5, 1.0, 0.0, 0.25],
    }
    with AtroposClient(config) as client, caplog.at_level(logging.WARNING, logger=LOGGER):
        client.register(num_steps=10)
        post_group(api, uneven)
        (group,) = client.next_batch()
        post_group(api, {**uneven, "scores": [1.0, 2.0]})
        assert client.poll_batch() is None
    assert group.token_ids == [[1, 2, 3], [1, 2, 6]]
    assert group.scores == [0.5, 0.25]
    assert group.loss_mask == [[0, 1, 1], [0, 1, 1]]
    reasons = "\n".join(caplog.messages)
    assert "row 1 of batch group 0 (env None): it has 3 tokens but 2 mask values" in reasons
    assert "row 2 of batch group 0 (env None): every mask value is -100" in reasons
    assert "its lists pair no rows, having 4 tokens, 4 masks, 2 scores" in reasons
    assert "held no well-formed group" in reasons


def test_fields_the_client_drops_are_warned_about_once(api, caplog):
    config = fresh(api, atropos_batch_size=1, atropos_max_wait_seconds=10)
    group = {"tokens": [[1, 2]], "masks": [[-100, 2]], "scores": [1.0], "ref_logprobs": [[0.0, -1.0]]}
    with AtroposClient(config) as client, caplog.at_level(logging.WARNING, logger=LOGGER):
        client.register(num_steps=10)
        for _ in range(2):
            post_group(api, group)
            client.next_batch()
    assert [message for message in caplog.messages if "ref_logprobs" in message] == [
        "Atropos groups carry 'ref_logprobs', which grpoflow ignores"
    ]


# -- errors -----------------------------------------------------------------------------------


def test_no_api_running_names_the_url_and_run_api():
    url = f"http://127.0.0.1:{free_port()}"
    with AtroposClient(AtroposConfig(atropos_url=url)) as client, pytest.raises(ValueError) as error:
        client.register(num_steps=10)
    assert url in str(error.value) and "run-api" in str(error.value)


def test_a_stalled_api_times_out_naming_the_setting():
    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen()  # connections are queued by the kernel and never answered
        url = f"http://127.0.0.1:{stalled.getsockname()[1]}"
        config = AtroposConfig(atropos_url=url, atropos_timeout=0.3)
        with AtroposClient(config) as client, pytest.raises(TimeoutError, match="atropos_timeout=0.3"):
            client.register(num_steps=10)


def test_waiting_past_the_limit_for_a_batch_raises(api):
    config = fresh(api, atropos_batch_size=4, atropos_max_wait_seconds=0.3)
    with AtroposClient(config) as client:
        client.register(num_steps=10)
        with pytest.raises(TimeoutError, match="atropos_max_wait_seconds") as error:
            client.next_batch()
    assert "'queue_size': 0" in str(error.value)


def test_a_second_registration_warns_that_the_api_keeps_the_first(api, caplog):
    first = fresh(api, atropos_batch_size=4)
    with AtroposClient(first) as client:
        client.register(num_steps=10)
    second = AtroposConfig(atropos_url=api, atropos_batch_size=8)
    with AtroposClient(second) as client, caplog.at_level(logging.WARNING, logger=LOGGER):
        client.register(num_steps=10)
    assert "keeps an earlier registration ({'batch_size': 4" in caplog.text
    assert "reset_data" in caplog.text


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ({"atropos_url": "localhost:8000"}, "atropos_url must be an http(s) URL"),
        ({"atropos_batch_size": 0}, "atropos_batch_size must be >= 1"),
        ({"atropos_poll_seconds": 0}, "atropos_poll_seconds must be > 0"),
        ({"atropos_timeout": -1}, "atropos_timeout must be > 0"),
        ({"atropos_max_wait_seconds": 0}, "atropos_max_wait_seconds must be > 0"),
        ({"atropos_save_checkpoint_interval": -1}, "atropos_save_checkpoint_interval must be >= 0"),
    ],
)
def test_bad_settings_name_the_field(setting, words):
    with pytest.raises(ValueError) as error:
        AtroposConfig(**setting)
    assert words in str(error.value)
