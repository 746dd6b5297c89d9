from grpoflow.run.failures import RewardFailureStreaks


def test_a_streak_counts_steps_in_a_row_and_a_good_step_resets_it():
    streaks = RewardFailureStreaks(["a", "b"], limit=2)
    assert streaks.update({"a"}) is None
    assert streaks.update({"b"}) is None  # a's streak broken, b's begins
    assert streaks.update({"a", "b"}) == "b"


def test_limit_zero_never_stops():
    streaks = RewardFailureStreaks(["a"], limit=0)
    assert all(streaks.update({"a"}) is None for _ in range(10))
