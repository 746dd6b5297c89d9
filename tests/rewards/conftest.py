"""Shared fixtures for the reward tests."""

from __future__ import annotations

import pytest

from grpoflow.rewards import registry


@pytest.fixture(autouse=True)
def restore_registry():
    """Undo registrations a test makes, so tests don't leak rewards into each other."""
    saved_registry = dict(registry.REWARD_REGISTRY)
    saved_orms = dict(registry.orms._entries)
    yield
    registry.REWARD_REGISTRY.clear()
    registry.REWARD_REGISTRY.update(saved_registry)
    registry.orms._entries.clear()
    registry.orms._entries.update(saved_orms)
