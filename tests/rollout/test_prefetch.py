"""The background rollout of asynchronous generation."""

from __future__ import annotations

import threading

import pytest

from grpoflow.rollout.prefetch import RolloutPrefetcher


def test_a_launched_rollout_runs_in_the_background_and_is_taken_once():
    prefetcher = RolloutPrefetcher()
    release = threading.Event()
    threads = []

    def produce():
        threads.append(threading.current_thread())
        release.wait(5)
        return "batch", {"rollout": 1.5}

    prefetcher.launch(produce, resume_state={"sampler": 3})
    assert prefetcher.pending and prefetcher.resume_state == {"sampler": 3}
    release.set()
    prefetched = prefetcher.take()
    assert (prefetched.value, prefetched.seconds, prefetched.resume_state) == (
        "batch",
        {"rollout": 1.5},
        {"sampler": 3},
    )
    assert threads[0] is not threading.current_thread()
    assert not prefetcher.pending and prefetcher.resume_state is None
    with pytest.raises(RuntimeError, match="no prefetched"):
        prefetcher.take()
    prefetcher.close()


def test_one_rollout_at_a_time_and_errors_surface_when_taken():
    prefetcher = RolloutPrefetcher()

    def fail():
        raise ValueError("server gone")

    prefetcher.launch(fail, resume_state=None)
    with pytest.raises(RuntimeError, match="still pending"):
        prefetcher.launch(fail, resume_state=None)
    prefetcher.wait()  # does not raise: the error belongs to whoever takes the batch
    with pytest.raises(ValueError, match="server gone"):
        prefetcher.take()
    prefetcher.close()
