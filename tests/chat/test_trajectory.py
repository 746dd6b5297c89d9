"""Chaining an agent program's recorded turns into training sequences, one per run of turns that
extend each other, against sequences written out by hand."""

from __future__ import annotations

import pytest

from grpoflow.chat.trajectory import chain_turns, chaining_runs


def turn(prompt, completion, finish="stop", version=3):
    return {
        "prompt_ids": prompt,
        "completion_ids": completion,
        "completion_logprobs": [-0.5 - index for index in range(len(completion))],
        "finish_reason": finish,
        "policy_version": version,
    }


def test_turns_that_extend_each_other_chain_with_the_inserted_ids_masked():
    turns = [turn([1, 2], [3, 4]), turn([1, 2, 3, 4, 9, 9], [5]), turn([1, 2, 3, 4, 9, 9, 5, 8], [6, 7])]
    trajectory = chain_turns(turns, 100)
    assert trajectory.prompt_ids == [1, 2]
    assert trajectory.ids == [3, 4, 9, 9, 5, 8, 6, 7]
    assert trajectory.mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert trajectory.logprobs == [-0.5, -1.5, 0.0, 0.0, -0.5, 0.0, -0.5, -1.5]
    assert (trajectory.num_turns, trajectory.num_dropped, trajectory.truncated) == (3, 0, False)


def test_a_turn_that_rewrites_history_starts_a_new_sequence_and_every_run_is_trained():
    turns = [
        turn([1, 2], [3]),
        turn([1, 7], [4], version=4),  # the history was rewritten: not [1, 2, 3, ...]
        turn([1, 7, 4, 9], [5], version=5),
    ]
    assert chaining_runs(turns) == [range(0, 1), range(1, 3)]
    trajectory = chain_turns(turns, 100)
    assert trajectory.prompt_ids == [1, 2]
    assert trajectory.ids == [3, 1, 7, 4, 9, 5] and trajectory.mask == [1, 0, 0, 1, 0, 1]
    assert trajectory.logprobs == [-0.5, 0.0, 0.0, -0.5, 0.0, -0.5]
    assert trajectory.starts == [1] and trajectory.num_segments == 2
    assert (trajectory.num_turns, trajectory.num_dropped, trajectory.policy_version) == (3, 0, 3)


def test_every_run_is_trained_whatever_its_length():
    trajectory = chain_turns([turn([1], [2]), turn([8], [9]), turn([8, 9, 6], [5, 4])], 100)
    assert trajectory.prompt_ids == [1] and trajectory.ids == [2, 8, 9, 6, 5, 4]
    assert trajectory.mask == [1, 0, 1, 0, 1, 1] and trajectory.starts == [1]
    assert trajectory.num_dropped == 0 and trajectory.num_turns == 3


def test_a_prompt_shorter_than_the_previous_turn_does_not_extend_it():
    assert len(chaining_runs([turn([1, 2], [3]), turn([1, 2], [3])])) == 2


def test_the_sequence_is_cut_at_max_completion_length_and_counts_as_truncated():
    turns = [turn([1], [2, 3]), turn([1, 2, 3, 4, 4], [5, 6])]
    trajectory = chain_turns(turns, 5)
    assert trajectory.ids == [2, 3, 4, 4, 5] and trajectory.mask == [1, 1, 0, 0, 1] and trajectory.truncated
    exact = chain_turns(turns, 6)
    assert exact.truncated and len(exact.ids) == 6  # the episode used its whole budget
    assert not chain_turns([turn([1], [2], finish="length")], 5).truncated  # a turn's own limit


def test_each_run_is_cut_after_its_own_prompt_and_a_turn_past_the_cut_is_dropped():
    turns = [turn([1], [2, 3]), turn([7, 7, 7], [8]), turn([7, 7, 7, 8, 6, 6], [5])]
    trajectory = chain_turns(turns, 3)
    assert trajectory.ids == [2, 3, 7, 7, 7, 8] and trajectory.starts == [2]  # run 2: [8] then [6, 6] ends it
    assert trajectory.mask == [1, 1, 0, 0, 0, 1] and trajectory.truncated
    assert (trajectory.num_turns, trajectory.num_dropped) == (2, 1)


def test_no_turns_is_refused():
    with pytest.raises(ValueError, match="no recorded turns"):
        chain_turns([], 10)
