"""Which forward the family path runs for a model type: the Llama layout's (`model`, with
Qwen3-MoE's sparse layers from `moe`) or Gemma 3's (`gemma`)."""

from __future__ import annotations

from torch import nn

from grpoflow.models.gemma import GEMMA_MODEL_TYPES, GemmaModel, gemma_refusal
from grpoflow.models.model import LLAMA_LAYOUT_TYPES, FamilyModel
from grpoflow.models.model import refusal as llama_refusal

SUPPORTED_MODEL_TYPES = LLAMA_LAYOUT_TYPES + GEMMA_MODEL_TYPES


def _model_type(hf_model: nn.Module) -> str | None:
    return getattr(getattr(hf_model, "config", None), "model_type", None)


def refusal(hf_model: nn.Module) -> str | None:
    """Why the family path cannot run `hf_model`; None when it can."""
    if _model_type(hf_model) in GEMMA_MODEL_TYPES:
        return gemma_refusal(hf_model)
    return llama_refusal(hf_model)


def family_model(hf_model: nn.Module) -> FamilyModel:
    """The family forward of a model that `refusal` accepts."""
    return GemmaModel(hf_model) if _model_type(hf_model) in GEMMA_MODEL_TYPES else FamilyModel(hf_model)
