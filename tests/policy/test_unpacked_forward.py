"""transformers' check for packed sequences skipped for rows of one sequence each (CPU)."""

import pytest
import torch
from transformers import masking_utils

from grpoflow.policy.tiny import build_tiny_model
from grpoflow.policy.unpacked_forward import unpacked_positions


@pytest.fixture
def counted(monkeypatch):
    """transformers' own check, counting its calls."""
    calls = []
    original = masking_utils.find_packed_sequence_indices

    def check(position_ids):
        calls.append(position_ids)
        return original(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", check)
    return calls


def test_an_unmasked_forward_inside_skips_the_check_and_gives_the_same_states(counted):
    model = build_tiny_model(40).eval()
    input_ids = torch.randint(1, 40, (3, 9))
    with torch.no_grad():
        expected = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
        assert len(counted) == 1  # transformers reads the positions for packing on its own
        with unpacked_positions():
            got = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    assert len(counted) == 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_check_comes_back_after_the_block_also_when_it_raises(counted):
    before = masking_utils.find_packed_sequence_indices
    with pytest.raises(RuntimeError, match="inside"), unpacked_positions():
        assert masking_utils.find_packed_sequence_indices is not before
        raise RuntimeError("inside")
    assert masking_utils.find_packed_sequence_indices is before
    positions = torch.tensor([[0, 1, 2, 0, 1]])  # two sequences packed in one row
    assert masking_utils.find_packed_sequence_indices(positions).tolist() == [[0, 0, 0, 1, 1]]
