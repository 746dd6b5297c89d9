"""LoRA through PEFT: training only the adapters, merged rollouts, the adapters-off reference,
adapter-only checkpoints, exact resume, `grpoflow export`."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("peft")

from helpers import support  # noqa: E402
from helpers.native_fixtures import one_thread  # noqa: E402, F401 (a fixture)

from grpoflow import cli  # noqa: E402
from grpoflow.algo import LogprobOptions, sequence_logprobs  # noqa: E402
from grpoflow.engines import (  # noqa: E402
    ENGINES,
    EngineCapabilities,
    EngineConfig,
    EngineOptions,
    SamplingParams,
    build_engine,
)
from grpoflow.policy import lora  # noqa: E402
from grpoflow.policy.loading import reference_model  # noqa: E402
from grpoflow.policy.lora import (  # noqa: E402
    AdapterConfig,  # noqa: E402
    WithoutAdapters,
    add_lora,
    generation_model,
    merged_adapters,
    merged_weights,
)
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpoflow.run.build import build_trainer, run  # noqa: E402

LORA = {"train_type": "lora", "modules_to_save": ["model.norm"]}
"""The tiny model ties its output head to embeddings of std 0.02 and ends in an RMSNorm, so with
those frozen its logits stay within about +-1.3: LoRA on the linear layers alone cannot move the
policy far. Training the final norm's 64 gains beside the adapters lifts that bound."""


def recipe(tmp_path, **overrides):
    return support.recipe(tmp_path, **{**LORA, **overrides})


def lora_model(*, seed: int = 0, **adapter) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny PeftModel whose adapters are non-zero, and a copy of its base model."""
    tokenizer = build_char_tokenizer()
    base = build_tiny_model(len(tokenizer), seed=seed, tie_word_embeddings=adapter.pop("tied", True))
    plain = copy.deepcopy(base).eval()
    model = add_lora(base, AdapterConfig(lora_dropout=0.0, **adapter))
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.2)
    return model.eval(), plain


def token_batch(vocab_size: int = 40, *, batch: int = 3, length: int = 12):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded prompt
    return ids, mask


def logits(model, ids, mask) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits


def test_lora_run_learns_the_echo_task_and_trains_only_the_adapters(tmp_path):
    config = recipe(tmp_path, max_steps=100, per_device_train_batch_size=128, learning_rate=0.2, lora_alpha=8)
    trainer = build_trainer(config)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or "modules_to_save" in name for name in trainable)
    history = run(config, trainer)
    rewards = [float(step["reward"]) for step in history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 3 * first + 0.03, (first, last)
    for name, parameter in trainer.model.named_parameters():
        if name in trainable:
            assert not torch.equal(parameter, before[name]), name
        else:
            assert torch.equal(parameter, before[name]), name  # bit for bit, merges included


def test_native_engine_rollouts_merge_nothing_and_leave_the_base_bit_for_bit(tmp_path, monkeypatch):
    def refuse(model):
        raise AssertionError("the native engine applies the adapters itself: nothing is merged")

    monkeypatch.setattr(lora, "merged_adapters", refuse)
    config = recipe(tmp_path, max_steps=4, learning_rate=0.05, beta=0.04, lora_dropout=0.1)
    trainer = build_trainer(config)
    assert trainer.engine.capabilities.applies_adapters
    frozen = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if not p.requires_grad}
    adapters = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_B" in name}
    history = run(config, trainer)
    assert len(history) == 4 and all(step.get("time/merge", 0) == 0 for step in history)
    parameters = dict(trainer.model.named_parameters())
    assert frozen and all(torch.equal(parameters[name], saved) for name, saved in frozen.items())
    assert any(not torch.equal(parameters[name], saved) for name, saved in adapters.items())


def test_merged_adapters_give_the_adapted_logits_and_restore_the_base_bit_for_bit():
    model, plain = lora_model(modules_to_save=["model.norm"])
    ids, mask = token_batch()
    adapted = logits(model, ids, mask)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    merged = dict(merged_weights(model))
    with merged_adapters(model):
        inner = generation_model(model)
        torch.testing.assert_close(logits(inner, ids, mask), adapted, rtol=1e-5, atol=1e-5)
        for name, tensor in inner.named_parameters():
            if ".base_layer." in name:  # merged in place, as merged_weights computes it
                assert torch.equal(merged[name.replace(".base_layer", "")], tensor), name
    assert not any(getattr(m, "merged", False) for m in model.modules())
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name
    torch.testing.assert_close(logits(model, ids, mask), adapted, rtol=0, atol=0)
    # merged_weights: the plain model's names and order, tied weights once, the trained norm.
    assert list(merged) == [name for name, _ in plain.named_parameters()]
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to embed_tokens
    torch.testing.assert_close(logits(plain, ids, mask), adapted, rtol=1e-5, atol=1e-5)


class CopyEngine:
    shares_policy_weights = False

    def __init__(self, accepts_adapters: bool, holds_base: bool = False) -> None:
        self.capabilities = EngineCapabilities(name="copy", accepts_adapters=accepts_adapters)
        self.holds_base = holds_base


@pytest.mark.parametrize(
    ("accepts", "holds_base", "want"),
    [
        (True, False, lambda model: lora.adapter_update(model, with_base=True)),
        (True, True, lambda model: lora.adapter_update(model, with_base=False)),
        (False, True, merged_weights),
    ],
)
def test_rollout_parts_give_the_whole_policys_sync_one_part_at_a_time(accepts, holds_base, want):
    # As a sharded policy walks them: the model less its decoder layers, then each layer.
    model, _ = lora_model(modules_to_save=["model.norm"])
    parts = lora.rollout_parts(model, CopyEngine(accepts, holds_base))
    assert parts == lora.RolloutParts(adapters=accepts, with_base=not (accepts and holds_base))
    base = generation_model(model)
    layers = base.model.layers
    seen: set[int] = set()
    pieces = list(parts.weights(base, "", seen, skip=(layers,)))
    for index, layer in enumerate(layers):
        pieces += parts.weights(layer, f"model.layers.{index}.", seen)
    whole = dict(want(model))
    assert sorted(name for name, _ in pieces) == sorted(whole)
    assert all(torch.equal(tensor, whole[name]) for name, tensor in pieces)
    synced = list(lora.merged_rollout_weights(model, CopyEngine(accepts, holds_base)))
    assert [name for name, _ in synced] == [name for name, _ in want(model)]  # the whole policy's order
    assert parts.needs(layers[0]) and lora.has_adapters(base, skip=(layers,))  # the trained norm
    plain, _ = lora_model()
    assert not lora.has_adapters(generation_model(plain), skip=(generation_model(plain).model.layers,))
    assert lora.has_adapters(generation_model(plain).model.layers[0])


@pytest.mark.parametrize("engine_name", ["hf", "native"])
def test_engines_generate_the_adapted_policy_inside_the_merge(engine_name):
    if engine_name not in ENGINES:
        pytest.skip(f"no {engine_name} engine registered")
    model, _ = lora_model()
    tokenizer = build_char_tokenizer()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = EngineOptions(engine=EngineConfig(max_model_len=64))
    reference = build_engine("hf", model, tokenizer, options).generate(prompts, greedy)  # PeftModel.generate
    engine = build_engine(engine_name, generation_model(model), tokenizer, options)
    with merged_adapters(model):
        merged = engine.generate(prompts, greedy)
    for want, got in zip(reference, merged, strict=True):
        assert got[0].token_ids == want[0].token_ids
        assert got[0].logprobs == pytest.approx(want[0].logprobs, abs=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_reference_with_adapters_off_is_the_base_model(tied):
    # untied, the output head carries an adapter too and the reference wraps it
    targets = ["all-linear"] if tied else ["q_proj", "v_proj", "lm_head"]
    model, plain = lora_model(tied=tied, target_modules=targets)
    model.train()
    reference = reference_model(model)
    assert isinstance(reference, WithoutAdapters)
    ids, mask = token_batch()
    kwargs = dict(logits_to_keep=6, options=LogprobOptions(chunk_size=5))  # several projection chunks
    with torch.no_grad():
        ref_logps, _ = sequence_logprobs(reference, ids, mask, **kwargs)
        base_logps, _ = sequence_logprobs(plain, ids, mask, **kwargs)
        policy_logps, _ = sequence_logprobs(model, ids, mask, **kwargs)
        full = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    torch.testing.assert_close(ref_logps, base_logps, rtol=1e-5, atol=1e-5)
    assert (policy_logps - base_logps).abs().max() > 1e-2
    # the chunked path through the PeftModel's decoder equals its full forward
    direct = full[:, -7:-1].gather(-1, ids[:, -6:, None])[..., 0]
    torch.testing.assert_close(policy_logps, direct, rtol=1e-5, atol=1e-5)
    assert model.training  # restored after each call of the reference
    assert all(p.requires_grad for name, p in model.named_parameters() if "lora_" in name)


def test_lora_with_kl_logs_a_finite_kl(tmp_path):
    history = run(recipe(tmp_path, max_steps=3, beta=0.1, learning_rate=0.05))
    assert all(math.isfinite(step["kl"]) for step in history)
    assert history[0]["kl"] == pytest.approx(0, abs=1e-6)  # lora_B starts at zero: policy = base
    assert history[-1]["kl"] > 0


def test_adapter_checkpoint_resumes_exactly_as_an_uninterrupted_run(tmp_path):
    settings = dict(max_steps=6, num_iterations=2, beta=0.05, learning_rate=0.05)
    history = run(recipe(tmp_path / "a", save_steps=3, **settings))
    saved = tmp_path / "a" / "run" / "checkpoint-3"
    files = {path.name for path in saved.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.json"} <= files
    assert not any(name.startswith("model") and name.endswith(".safetensors") for name in files)
    trainer = build_trainer(recipe(tmp_path / "b", resume_from_checkpoint=str(saved), **settings))
    assert trainer.step_count == 3
    resumed = trainer.train()
    for expected, got in zip(history[3:], resumed, strict=True):
        assert got["reward"] == expected["reward"]
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-7)
        assert got["kl"] == pytest.approx(expected["kl"], abs=1e-7)
    reference = build_trainer(recipe(tmp_path / "a", resume_from_checkpoint="latest", **settings)).model
    for (name, want), (_, got) in zip(reference.state_dict().items(), trainer.model.state_dict().items()):
        torch.testing.assert_close(got, want, msg=name)


def test_resume_refuses_a_checkpoint_of_other_training_settings(tmp_path):
    run(recipe(tmp_path, max_steps=1, lora_rank=4))
    saved = str(tmp_path / "run" / "checkpoint-1")
    with pytest.raises(ValueError, match="trained with lora_rank=4 but this run has lora_rank=8"):
        build_trainer(recipe(tmp_path, max_steps=2, resume_from_checkpoint=saved))
    with pytest.raises(ValueError, match="holds a LoRA adapter but this run has train_type=full"):
        build_trainer(recipe(tmp_path, max_steps=2, train_type="full", resume_from_checkpoint=saved))


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_add_lora_refuses_what_would_break_merged_rollouts():
    tokenizer = build_char_tokenizer()
    with pytest.raises(ValueError, match="lm_head shares its weight with model.embed_tokens.weight"):
        add_lora(build_tiny_model(len(tokenizer)), AdapterConfig(target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="all-linear already targets every linear layer"):
        add_lora(build_tiny_model(len(tokenizer)), AdapterConfig(target_modules=["all-linear", "q_proj"]))
    with pytest.raises(ValueError, match="module names of the model"):
        add_lora(build_tiny_model(len(tokenizer)), AdapterConfig(target_modules=["no_such_proj"]))


def test_export_merges_the_adapter_into_a_standalone_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = recipe(tmp_path, max_steps=3, learning_rate=0.05)
    trainer = build_trainer(config)
    run(config, trainer)
    output = tmp_path / "exported"
    assert (
        cli.main(["export", "--checkpoint", str(tmp_path / "run" / "checkpoint-3"), "--output", str(output)])
        == 0
    )
    policy = trainer.model.eval()
    exported = AutoModelForCausalLM.from_pretrained(output).to(next(policy.parameters()).device).eval()
    assert AutoTokenizer.from_pretrained(output).decode([5, 6]) == trainer.tokenizer.decode([5, 6])
    ids, mask = token_batch()
    with merged_adapters(policy):
        merged = logits(policy, ids, mask)
    torch.testing.assert_close(logits(exported, ids, mask), merged, rtol=0, atol=0)
    torch.testing.assert_close(logits(exported, ids, mask), logits(policy, ids, mask), rtol=1e-5, atol=1e-5)
    assert "exported" in capsys.readouterr().out


def test_export_of_a_full_checkpoint_copies_the_model(tmp_path):
    from transformers import AutoModelForCausalLM

    config = recipe(tmp_path, max_steps=1, train_type="full", modules_to_save=[])
    trainer = build_trainer(config)
    run(config, trainer)
    output = tmp_path / "exported"
    assert (
        cli.main(["export", "--checkpoint", str(tmp_path / "run" / "checkpoint-1"), "--output", str(output)])
        == 0
    )
    assert not any((output / name).exists() for name in ("trainer_state.json", "trainer_state.tensors"))
    ids, mask = token_batch()
    policy = trainer.model.eval()
    exported = AutoModelForCausalLM.from_pretrained(output).to(next(policy.parameters()).device).eval()
    torch.testing.assert_close(logits(exported, ids, mask), logits(policy, ids, mask), rtol=0, atol=0)


def test_export_errors_are_usage_errors(tmp_path, capsys):
    assert cli.main(["export", "--checkpoint", str(tmp_path), "--output", str(tmp_path / "out")]) == 2
    assert "is not a complete checkpoint directory" in capsys.readouterr().err
    run(recipe(tmp_path, max_steps=1))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    checkpoint = str(tmp_path / "run" / "checkpoint-1")
    assert cli.main(["export", "--checkpoint", checkpoint, "--output", str(tmp_path / "taken")]) == 2
    assert "already exists and is not an empty directory" in capsys.readouterr().err
