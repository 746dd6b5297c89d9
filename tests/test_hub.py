import pytest
from helpers.support import free_port

from grpoflow import hub
from grpoflow.policy.loading import load_tokenizer


@pytest.fixture
def closed_hub(monkeypatch):
    for name in hub.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there


def test_a_closed_hub_is_unreachable_unless_offline_mode_is_set(closed_hub, monkeypatch):
    assert hub.unreachable()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.offline() and not hub.unreachable()


def test_a_model_name_fails_at_once_when_the_hub_is_unreachable(closed_hub):
    with pytest.raises(
        ValueError, match=r"model 'someone/no-such-model' is not local, and the hub .* HF_HUB_OFFLINE=1"
    ):
        load_tokenizer("someone/no-such-model")
