"""The native engine's batch-invariant forward against the training forward with the kernels
installed (CPU: `batch_invariant_cpu`'s torch paths, bfloat16): each keyed draw and its log-prob
come from the same logits bit for bit (Qwen2, Llama, Qwen3, LoRA policies), prompts served from
the prefix cache included, the engine's scores the update's where the head is a plain one; what the kernels cannot reproduce is refused; removing them leaves the
stock model."""

from __future__ import annotations

import pytest
import torch
from helpers.native_fixtures import expert_lora, one_thread, tiny, tiny_moe  # noqa: F401 (a fixture)
from torch import nn

from grpoflow.algo.draws import gumbel_draw, request_keys
from grpoflow.algo.logprobs import completion_hidden, token_logprobs_from_hidden
from grpoflow.engines import SamplingParams, prefix_cache_metrics
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.policy.batch_invariant import NAME, BatchInvariantKernels, scores_match, wanted

pytest.importorskip("triton")
pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402

from grpoflow.policy.lora import AdapterConfig, add_lora, generation_model  # noqa: E402

PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [12, 13, 14, 15, 16]]
SEED, SAMPLES, TOKENS = 7, 3, 12
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def engine(model, batch_invariant: bool = True) -> NativeEngine:
    config = NativeEngineConfig(
        max_num_seqs=8, block_size=4, num_kv_blocks=128, batch_invariant=batch_invariant
    )
    return NativeEngine(model, config=config)


def trainer_draws(model, prompt: list[int], completions: list[list[int]]) -> list[tuple]:
    """The trainer's keyed draws of each completion from one left-padded batch, and their log-probs
    as the update scores them."""
    length = len(prompt) + max(map(len, completions))
    ids = torch.zeros(len(completions), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, completion in enumerate(completions):
        sequence = prompt + completion
        ids[row, length - len(sequence) :] = torch.tensor(sequence)
        mask[row, length - len(sequence) :] = 1
    with torch.no_grad():
        hidden = completion_hidden(model.get_decoder(), ids, mask, length - len(prompt))
        logits = model.get_output_embeddings()(hidden)
    draws = []
    for row, completion in enumerate(completions):
        keys = torch.from_numpy(request_keys(SEED, row, len(completion)))
        start = logits.shape[1] - len(completion)
        tokens, _ = gumbel_draw(logits[row, start:], keys, 1.0, None)
        head = model.get_output_embeddings()
        scores, _ = token_logprobs_from_hidden(hidden[row : row + 1, start:], head, tokens[None], 1.0)
        draws.append((tokens, scores[0]))
    return draws


def lora_policy(peft_casting: bool) -> nn.Module:
    """A tiny bfloat16 policy with LoRA adapters (float32, B drawn nonzero) on every linear layer:
    grpoflow's (`add_lora`: the products in bfloat16), or PEFT's own (the branch in float32, the
    output head adapted too). Returns the PeftModel."""
    if peft_casting:
        config = LoraConfig(r=4, lora_alpha=5, lora_dropout=0.0, target_modules=[*LINEAR, "lm_head"])
        policy = get_peft_model(tiny(dtype=torch.bfloat16, tie_word_embeddings=False), config)
    else:
        adapters = AdapterConfig(
            train_type="lora", lora_rank=4, lora_alpha=5, lora_dropout=0.0, target_modules=LINEAR
        )
        policy = add_lora(tiny(dtype=torch.bfloat16), adapters)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return policy.eval()


def policy_of(case: str) -> nn.Module:
    """The case's policy in bfloat16: a model type, `qwen3_moe` (`tiny_moe`: a dense layer among
    sparse ones) or `qwen3_moe-unnormalised` (its top-k weights not renormalised), or `lora` /
    `peft-lora` (`lora_policy`)."""
    if case.startswith("qwen3_moe"):
        return tiny_moe(norm_topk_prob=case == "qwen3_moe", dtype=torch.bfloat16)
    if case.endswith("lora"):
        return lora_policy(peft_casting=case == "peft-lora")
    return tiny(case, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "case", ["qwen2", "llama", "qwen3", "qwen3_moe", "qwen3_moe-unnormalised", "lora", "peft-lora"]
)
def test_each_draw_and_log_prob_is_the_training_forwards_bit_for_bit(case):
    policy = policy_of(case)
    BatchInvariantKernels.install(policy)
    model = generation_model(policy)
    rollout = engine(model)
    assert rollout.family.fused[0].qkv_weight is not None  # one product for q/k/v, apart in training
    params = SamplingParams(n=SAMPLES, max_tokens=TOKENS, temperature=1.0, seed=SEED, draw="gumbel")
    first = rollout.generate(PROMPTS, params)
    again = rollout.generate(PROMPTS, params)  # the prompts' full blocks now come from the cache
    assert prefix_cache_metrics(rollout.stats.prefill)["rollout/prefix_cache_hit_tokens"] > 0
    for prompt, completions, repeated in zip(PROMPTS, first, again):
        assert [c.token_ids for c in repeated] == [c.token_ids for c in completions]
        assert [c.logprobs for c in repeated] == [c.logprobs for c in completions]
        draws = trainer_draws(model, prompt, [c.token_ids for c in completions])
        for completion, (tokens, logprobs) in zip(completions, draws):
            assert tokens.tolist() == completion.token_ids
            if scores_match(policy):  # else the head is an adapter's, which the update scores itself
                assert torch.equal(logprobs, torch.tensor(completion.logprobs))
    assert scores_match(policy) == (case != "peft-lora")


def test_what_the_kernels_cannot_reproduce_is_refused():
    with pytest.raises(ValueError, match="mistral"):
        engine(tiny("mistral"))
    with pytest.raises(ValueError, match="mistral"):
        BatchInvariantKernels.install(tiny("mistral"))
    with pytest.raises(ValueError, match="torch_compile"):
        BatchInvariantKernels.install(tiny(), torch_compile=True)
    dropout = get_peft_model(tiny(), LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="lora_dropout: 0"):
        BatchInvariantKernels.install(dropout)
    with pytest.raises(ValueError, match="LoRA adapters on the experts"):
        BatchInvariantKernels.install(expert_lora(tiny_moe()))
    dora = get_peft_model(tiny(), LoraConfig(r=4, use_dora=True, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="LoRA adapters the family forward does not apply"):
        BatchInvariantKernels.install(dora)
    name = "model.layers.0.self_attn.q_proj"
    sent = [(f"{name}.lora_A.weight", torch.zeros(4, 64)), (f"{name}.lora_B.weight", torch.zeros(64, 4))]
    with pytest.raises(ValueError, match="no adapters sent as tensors"):
        engine(tiny()).update_weights(sent, version=1)


def test_removing_the_kernels_leaves_the_stock_model():
    model = tiny()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        kernels = BatchInvariantKernels.install(model)
        assert model.config._attn_implementation == NAME
        torch.testing.assert_close(model(input_ids=ids).logits, stock, atol=1e-5, rtol=1e-5)
        kernels.remove()
        assert torch.equal(model(input_ids=ids).logits, stock)
    assert not any("forward" in vars(module) for module in model.modules())
    assert model.config._attn_implementation == "sdpa"


def test_auto_is_on_with_on_policy_sampling_on_cuda_only():
    assert wanted("auto", True, torch.device("cuda"))
    assert not wanted("auto", True, torch.device("cpu"))
    assert not wanted("auto", False, torch.device("cuda"))
    assert wanted(True, False, torch.device("cpu")) and not wanted(False, True, torch.device("cuda"))


def test_auto_leaves_the_kernels_off_where_they_cannot_serve(monkeypatch):
    import grpoflow.policy.batch_invariant as policy_side

    monkeypatch.setattr(policy_side, "wanted", lambda *args: True)  # as on CUDA with on_policy_sampling
    model = tiny("mistral")
    assert policy_side.install_if_wanted("auto", True, model, torch_compile=False) is None
    assert not policy_side.installed(model)
    assert policy_side.install_if_wanted("auto", True, tiny(), torch_compile=True) is None
    kernels = policy_side.install_if_wanted("auto", True, model := tiny(), torch_compile=False)
    assert kernels is not None and policy_side.installed(model)
    with pytest.raises(ValueError, match="mistral"):
        policy_side.install_if_wanted(True, True, tiny("mistral"), torch_compile=False)
