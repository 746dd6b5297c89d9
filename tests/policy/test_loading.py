"""Building the policy from its config (CPU): the attention kernel and a MoE model's experts
implementation it trains with."""

from __future__ import annotations

import pytest
import torch
from helpers.support import recipe

from grpoflow.policy.loading import PolicyConfig, load_checkpoint_weights
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model
from grpoflow.run.build import run


def build(**options):
    return PolicyConfig(**{"model": "tiny", **options}).build(
        vocab_size=52, seed=0, device=torch.device("cpu")
    )


def test_the_attention_kernel_is_the_models_default_unless_chosen():
    assert build().config._attn_implementation == "sdpa"
    assert build(attn_implementation="eager").config._attn_implementation == "eager"
    assert build(attn_implementation="flex_attention").config._attn_implementation == "flex_attention"
    assert build(attn_implementation="grpoflow_varlen").config._attn_implementation == "grpoflow_varlen"


def test_a_kernel_that_does_not_load_is_named_with_the_fix():
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'.*leave it unset"):
        build(attn_implementation="flash_attention_2")  # no flash-attn package on this machine


def test_a_moe_models_experts_run_eager_on_the_cpu_unless_chosen_and_a_dense_model_takes_no_choice(caplog):
    with caplog.at_level("INFO", logger="grpoflow.policy.loading"):
        assert build(model="random:tiny-moe").config._experts_implementation == "eager"
    assert "run their experts with eager (the default on cpu)" in caplog.text
    chosen = build(model="random:tiny-moe", experts_implementation="batched_mm")
    assert chosen.config._experts_implementation == "batched_mm"
    with pytest.raises(ValueError, match="experts_implementation='grouped_mm' applies to mixture-of-experts"):
        build(experts_implementation="grouped_mm")


def test_checkpointing_marks_a_dense_models_recompute_and_not_a_moe_models():
    """The recompute context lets batch-invariant kernels hand a recompute to torch's ops; a MoE
    layer recomputes exactly, so that its router chooses the same experts again."""
    from grpoflow.kernels.recompute import checkpoint_contexts

    def options(model):
        return model.model.layers[0]._gradient_checkpointing_func.keywords

    dense = options(build(gradient_checkpointing=True))
    assert dense == {"use_reentrant": False, "context_fn": checkpoint_contexts}
    assert options(build(model="random:tiny-moe", gradient_checkpointing=True)) == {"use_reentrant": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention has no backward on the CPU")
def test_padding_free_trains_with_flex_attention(tmp_path):
    flex = run(recipe(tmp_path, max_steps=2, padding_free=True, attn_implementation="flex_attention"))
    padded = run(recipe(tmp_path / "padded", max_steps=2))
    # The first step samples the same completions; the loss differs by the kernels' rounding.
    assert flex[0]["reward"] == pytest.approx(padded[0]["reward"])
    assert flex[0]["loss"] == pytest.approx(padded[0]["loss"], abs=1e-2)


def test_a_moe_checkpoint_in_the_hugging_face_layout_loads_back_into_the_fused_experts(tmp_path):
    # save_pretrained writes each expert's projections apart; the model holds them fused.
    def tiny_moe(seed: int) -> torch.nn.Module:
        return build_preset_model(
            "tiny-moe", len(build_char_tokenizer()), seed=seed, device=torch.device("cpu")
        )

    saved, resumed = tiny_moe(1), tiny_moe(2)
    saved.save_pretrained(tmp_path)
    load_checkpoint_weights(resumed, tmp_path)
    want = saved.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in want
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_an_attention_the_model_cannot_take_is_refused_unless_it_was_chosen(monkeypatch, caplog):
    from grpoflow.policy import loading

    model = build_preset_model("tiny", 32)

    def refuse(implementation):
        raise ValueError(f"{implementation} is not supported by this model")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    with pytest.raises(ValueError, match="does not load for this model.*leave it unset for sdpa"):
        loading.set_attention(model, PolicyConfig(attn_implementation="grpoflow_varlen"))
    with caplog.at_level("WARNING", logger="grpoflow.policy.loading"):
        loading.set_attention(model, PolicyConfig(attn_implementation="grpoflow_varlen", attn_fallback=True))
    assert "it keeps its own, and its updates run padded" in caplog.text
