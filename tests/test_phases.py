"""PhaseTimer: nested phases keep their own seconds, and `phase` charges the active timer."""

from __future__ import annotations

import threading
import time

import pytest

from grpoflow.phases import PhaseTimer, phase


def test_nested_phases_keep_their_own_seconds():
    timer = PhaseTimer(synchronize=False)
    with timer.active(), timer.measure():
        with phase("update"):
            time.sleep(0.02)
            with phase("reference"):
                time.sleep(0.03)
        with phase("update"):
            time.sleep(0.01)
    # update: 0.02 + 0.01 of its own (the 0.03 nested in it is reference's), reference 0.03.
    assert timer.seconds["update"] == pytest.approx(0.03, abs=0.01)
    assert timer.seconds["reference"] == pytest.approx(0.03, abs=0.01)
    assert sum(timer.seconds.values()) == pytest.approx(timer.total, abs=0.005)
    assert timer.unaccounted() == pytest.approx(0.0, abs=0.005)


def test_phase_without_an_active_timer_does_nothing_and_threads_keep_their_own():
    with phase("merge"):
        pass
    timer, other = PhaseTimer(synchronize=False), PhaseTimer(synchronize=False)

    def background() -> None:
        with other.active(), phase("rollout"):
            time.sleep(0.01)

    with timer.active():
        thread = threading.Thread(target=background)
        thread.start()
        thread.join()
        with phase("update"):
            pass
    assert set(timer.seconds) == {"update"} and set(other.seconds) == {"rollout"}


def test_add_charges_a_phase_and_the_total():
    timer = PhaseTimer(synchronize=False)
    timer.add("log", 0.5)
    assert timer.seconds["log"] == timer.total == 0.5
