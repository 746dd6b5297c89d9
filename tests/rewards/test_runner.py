import asyncio
import logging
import math
import os
import textwrap
import threading
import time

import pytest
import torch

from grpoflow.rewards import RewardConfig, RewardRunner, get_reward, load_plugins
from grpoflow.rewards import runner as runner_module


def reward_len(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]


def fails_on_bad(completions, **kwargs):
    if any("bad" in c for c in completions):
        raise ValueError("bad completion")
    return [1.0] * len(completions)


def slow(completions, **kwargs):
    time.sleep(3.0)
    return [1.0] * len(completions)


def worker_pid(completions, **kwargs):
    return [float(os.getpid())] * len(completions)


worker_pid.cpu_heavy = True


def sleepy_in_worker(completions, **kwargs):
    if completions[0] == "sleep":
        time.sleep(30.0)
    return [float(os.getpid())] * len(completions)


sleepy_in_worker.cpu_heavy = True


def sleepy_anywhere(completions, **kwargs):
    """Not marked cpu_heavy: starts in a thread."""
    if completions[0] == "sleep":
        time.sleep(5.0)
    return [float(os.getpid())] * len(completions)


async def async_half_second(completions, **kwargs):
    await asyncio.sleep(0.5)
    return [1.0] * len(completions)


async def async_other_half_second(completions, **kwargs):
    await asyncio.sleep(0.5)
    return [2.0] * len(completions)


class AsyncCallable:
    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(0.01)
        return [3.0] * len(completions)


def score(runner, completions, **columns):
    size = len(completions)
    return runner.score(["prompt"] * size, completions, [[1] * len(c) for c in completions], columns)


def test_scores_several_functions_in_order():
    funcs = [("format", get_reward("format")), ("reward_len", reward_len)]
    with RewardRunner(funcs, timeout=10, num_workers=0) as runner:
        batch = score(runner, ["<think>a</think><answer>1</answer>", "x" * 25])
    assert batch.names == ["format", "reward_len"]
    assert batch.values.dtype == torch.float32 and batch.values.shape == (2, 2)
    assert batch.values.tolist() == [[1.0, -14.0], [0.0, -5.0]]
    assert batch.weights.tolist() == [1.0, 1.0]
    assert batch.errors == [] and set(batch.seconds_per_func) == {"format", "reward_len"}


def test_weights_must_match_functions():
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        RewardRunner([("len", reward_len)], weights=[1.0, 2.0])
    runner = RewardRunner([("len", reward_len)], weights=[0.5])
    assert runner.weights.tolist() == [0.5]


def test_bad_construction_is_explained():
    with pytest.raises(ValueError, match="unique"):
        RewardRunner([("a", reward_len), ("a", reward_len)])
    with pytest.raises(ValueError, match="not callable"):
        RewardRunner([("a", 3)])
    with pytest.raises(ValueError, match="'fork' is unsafe"):
        RewardRunner([("a", reward_len)], mp_context="fork")


def test_raising_sample_gets_nan_and_others_keep_values(caplog):
    runner = RewardRunner([("fails", fails_on_bad), ("len", reward_len)], timeout=10, num_workers=0)
    with runner, caplog.at_level(logging.WARNING, logger="grpoflow.rewards"):
        batch = score(runner, ["good", "a bad one", "fine"])
    assert batch.values[:, 0].tolist()[0] == 1.0 and batch.values[2, 0].item() == 1.0
    assert math.isnan(batch.values[1, 0].item())
    assert batch.values[:, 1].tolist() == [-16.0, -11.0, -16.0]
    (error,) = batch.errors
    assert (error.name, error.index) == ("fails", 1)
    assert "ValueError: bad completion" in error.message and "a bad one" in error.message
    assert "reward 'fails' (sample 1)" in caplog.text


def test_timeout_gives_nan_and_returns_promptly():
    with RewardRunner([("slow", slow), ("len", reward_len)], timeout=0.3, num_workers=0) as runner:
        start = time.perf_counter()
        batch = score(runner, ["a", "b"])
        elapsed = time.perf_counter() - start
    assert elapsed < 2.0
    assert torch.isnan(batch.values[:, 0]).all() and batch.values[:, 1].tolist() == [-19.0, -19.0]
    (error,) = batch.errors
    assert (
        error.index is None and "timed out after 0.3 s" in error.message and "reward_timeout" in error.message
    )


def test_async_functions_run_concurrently():
    funcs = [("a", async_half_second), ("b", async_other_half_second), ("c", AsyncCallable())]
    with RewardRunner(funcs, timeout=10, num_workers=0) as runner:
        start = time.perf_counter()
        batch = score(runner, ["x", "y"])
        elapsed = time.perf_counter() - start
    assert batch.values.tolist() == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    assert elapsed < 0.9


def test_sync_functions_run_concurrently():
    def nap(completions, **kwargs):
        time.sleep(0.5)
        return [1.0] * len(completions)

    with RewardRunner([("a", nap), ("b", nap)], timeout=10, num_workers=0) as runner:
        start = time.perf_counter()
        score(runner, ["x"])
        assert time.perf_counter() - start < 0.9


def test_async_function_raising_on_one_sample():
    async def picky(completions, **kwargs):
        if "bad" in completions:
            raise KeyError("nope")
        return [1.0] * len(completions)

    with RewardRunner([("picky", picky)], timeout=10, num_workers=0) as runner:
        batch = score(runner, ["bad", "ok"])
    assert math.isnan(batch.values[0, 0].item()) and batch.values[1, 0].item() == 1.0
    assert [(e.name, e.index) for e in batch.errors] == [("picky", 0)]


def test_blocking_async_function_does_not_hang(monkeypatch):
    async def blocks(completions, **kwargs):
        time.sleep(1.0)
        return [1.0] * len(completions)

    monkeypatch.setattr(runner_module, "LOOP_GRACE_SECONDS", 0.2)
    with RewardRunner([("blocks", blocks)], timeout=0.2, num_workers=0) as runner:
        start = time.perf_counter()
        batch = score(runner, ["x"])
        assert time.perf_counter() - start < 0.9
    assert torch.isnan(batch.values).all() and "event loop was blocked" in batch.errors[0].message


def test_wrong_returns_are_reported():
    def not_a_list(completions, **kwargs):
        return 1.0

    def too_short(completions, **kwargs):
        return [1.0]

    def text_value(completions, **kwargs):
        return [1.0, "high"]

    funcs = [("not_a_list", not_a_list), ("too_short", too_short), ("text_value", text_value)]
    with RewardRunner(funcs, timeout=10, num_workers=0) as runner:
        batch = score(runner, ["a", "b"])
    assert torch.isnan(batch.values[:, :2]).all() and batch.values[0, 2].item() == 1.0
    messages = {(e.name, e.index): e.message for e in batch.errors}
    assert "returned float 1.0" in messages[("not_a_list", None)]
    assert "returned 1 values for 2 completions" in messages[("too_short", None)]
    assert "returned str 'high'" in messages[("text_value", 1)]


def test_missing_values_are_nan_without_errors():
    def partial(completions, **kwargs):
        return [None, 1.0, float("nan")]

    with RewardRunner([("partial", partial)], weights=[0.5], timeout=10, num_workers=0) as runner:
        batch = score(runner, ["a", "b", "c"])
    assert batch.errors == [] and batch.weights.tolist() == [0.5]
    values = batch.values[:, 0].tolist()
    assert math.isnan(values[0]) and values[1] == 1.0 and math.isnan(values[2])


def test_columns_and_extra_kwargs_reach_the_functions():
    seen = {}

    def spy(completions, answer, trainer_state=None, **kwargs):
        seen.update(answer=answer, trainer_state=trainer_state)
        return [0.0] * len(completions)

    with RewardRunner([("spy", spy)], num_workers=0) as runner:
        runner.score(["p"], ["c"], [[1]], {"answer": ["#### 1"]}, trainer_state={"step": 4})
    assert seen == {"answer": ["#### 1"], "trainer_state": {"step": 4}}


def test_empty_batch_and_bad_lengths():
    with RewardRunner([("len", reward_len)], num_workers=0) as runner:
        assert runner.score([], [], [], {}).values.shape == (0, 1)
        with pytest.raises(ValueError, match="completion_ids"):
            runner.score(["p"], ["c"], [], {})
        with pytest.raises(ValueError, match="clash"):
            runner.score(["p"], ["c"], [[1]], {"completions": ["x"]})


def test_many_errors_are_logged_with_a_count(caplog):
    def always(completions, **kwargs):
        raise RuntimeError("down")

    runner = RewardRunner([("always", always)], num_workers=0)
    with runner, caplog.at_level(logging.WARNING, logger="grpoflow.rewards"):
        batch = score(runner, ["a", "b", "c", "d", "e"])
    assert len(batch.errors) == 5
    assert caplog.text.count("RuntimeError: down") == runner_module.MAX_LOGGED_ERRORS
    assert "2 more reward errors" in caplog.text


def test_from_config_resolves_specs():
    config = RewardConfig(
        reward_funcs=["format", "soft_overlong", reward_len],
        reward_timeout=5,
        reward_num_workers=0,
        soft_cache_length=2,
        max_completion_length=4,
    )
    with RewardRunner.from_config(config) as runner:
        assert runner.names == ["format", "soft_overlong", "reward_len"]
        assert runner.kinds == ["thread", "thread", "thread"]
        batch = runner.score(["p"], ["x" * 20], [[1, 2, 3]], {})
    assert batch.values.tolist() == [[0.0, -0.5, 0.0]]


def test_process_pool_runs_cpu_heavy_functions(tmp_path, caplog):
    plugin = tmp_path / "heavy_plugin.py"
    plugin.write_text(
        textwrap.dedent(
            """
            import os

            def plugin_pid(completions, **kwargs):
                return [float(os.getpid())] * len(completions)

            plugin_pid.cpu_heavy = True
            """
        )
    )
    (module,) = load_plugins([plugin])
    closure_value = 1.0

    def unpicklable(completions, **kwargs):
        return [closure_value] * len(completions)

    unpicklable.cpu_heavy = True
    funcs = [
        ("accuracy", get_reward("accuracy")),
        ("pid", worker_pid),
        ("plugin_pid", module.plugin_pid),
        ("unpicklable", unpicklable),
    ]
    completions = ["<answer>72</answer>", "The answer is 72.", "\\boxed{72}", "71"]
    runner = RewardRunner(funcs, timeout=30, num_workers=2)
    with runner, caplog.at_level(logging.WARNING, logger="grpoflow.rewards"):
        assert runner.kinds == ["process"] * 4
        batch = runner.score(
            ["prompt"] * 4,
            completions,
            [[1]] * 4,
            {"answer": ["#### 72"] * 4},
            trainer_state={"step": 1},
            log_metric=lambda name, value: None,  # can't be pickled: not sent to the workers
        )
    assert batch.values[:, 0].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert os.getpid() not in batch.values[:, 1].tolist() + batch.values[:, 2].tolist()
    (error,) = batch.errors
    assert error.name == "unpicklable" and "must be picklable" in error.message
    assert "'log_metric' can't be pickled" in caplog.text


def test_process_pool_timeout_restarts_the_pool():
    with RewardRunner([("sleepy", sleepy_in_worker)], timeout=30, num_workers=1) as runner:
        first_pid = score(runner, ["fast"]).values[0, 0].item()
        runner.timeout = 0.5
        start = time.perf_counter()
        timed_out = score(runner, ["sleep"])
        assert time.perf_counter() - start < 3.0
        assert torch.isnan(timed_out.values).all() and "timed out" in timed_out.errors[0].message
        runner.timeout = 30
        second_pid = score(runner, ["fast"]).values[0, 0].item()
    assert second_pid != first_pid


def test_a_sync_function_past_its_timeout_is_not_started_again_while_its_thread_runs():
    calls, release = [], threading.Event()

    def blocks_once(completions, **kwargs):  # a closure: cannot move to a worker process
        calls.append(completions[0])
        if len(calls) == 1:
            release.wait(30)
        return [1.0] * len(completions)

    with RewardRunner([("blocks", blocks_once), ("len", reward_len)], timeout=0.3, num_workers=1) as runner:
        score(runner, ["a"])
        refused = score(runner, ["b"])
        assert calls == ["a"] and runner.kinds == ["thread", "thread"]
        assert "overran reward_timeout and is still running" in refused.errors[0].message
        assert refused.values[0, 1].item() == -19.0
        release.set()
        time.sleep(0.2)
        assert score(runner, ["c"]).values[0, 0].item() == 1.0
    assert calls == ["a", "c"]


def test_a_picklable_sync_function_past_its_timeout_moves_to_the_process_pool(caplog):
    with RewardRunner([("sleepy", sleepy_anywhere)], timeout=0.5, num_workers=1) as runner:
        assert score(runner, ["fast"]).values[0, 0].item() == os.getpid()
        with caplog.at_level(logging.WARNING, logger="grpoflow.rewards"):
            assert "timed out" in score(runner, ["sleep"]).errors[0].message
        assert runner.kinds == ["process"] and "runs in the process pool from now on" in caplog.text
        assert score(runner, ["fast"]).values[0, 0].item() != os.getpid()
        start = time.perf_counter()
        score(runner, ["sleep"])  # a process is killed at its timeout
        assert time.perf_counter() - start < 3.0


def test_cpu_heavy_runs_in_a_thread_without_workers():
    with RewardRunner([("accuracy", get_reward("accuracy"))], num_workers=0) as runner:
        assert runner.kinds == ["thread"]
        batch = score(runner, ["\\boxed{72}", "7"], answer=["#### 72"] * 2)
    assert batch.values[:, 0].tolist() == [1.0, 0.0]


def test_failed_everywhere_names_functions_that_failed_on_every_sample():
    def wrong_length(completions, **kwargs):
        return [1.0]

    funcs = [("fails", fails_on_bad), ("wrong", wrong_length), ("len", reward_len)]
    with RewardRunner(funcs, timeout=10, num_workers=0) as runner:
        assert score(runner, ["bad", "bad too"]).failed_everywhere == {"fails", "wrong"}
        assert score(runner, ["bad", "good"]).failed_everywhere == {"wrong"}
