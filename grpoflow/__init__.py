"""grpoflow: GRPO post-training. `from grpoflow import GRPOConfig, GRPOTrainer` is the Python API
in TRL's shape (`grpoflow.api`); `grpoflow train` the command line. Importing the package loads
nothing else: the API loads on first use."""

from typing import Any

__all__ = ["GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from grpoflow import api

        return getattr(api, name)
    raise AttributeError(f"module 'grpoflow' has no attribute {name!r}")
