"""Decoder layers compiled beside training (CPU, Dynamo's eager backend): they run eagerly while
the thread compiles, switch only between passes, and train on the thread's graph without
tracing again."""

from __future__ import annotations

import logging

import pytest
import torch

from grpoflow.policy import background_compile
from grpoflow.policy.background_compile import CompiledBeside
from grpoflow.policy.compiling import compile_layers
from grpoflow.policy.tiny import build_char_tokenizer, build_preset_model


def tiny_model(gradient_checkpointing: bool = False) -> torch.nn.Module:
    model = build_preset_model("tiny", len(build_char_tokenizer()), seed=3, dtype=torch.float32, device="cpu")
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def gradients(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(input_ids=ids).logits.square().mean().backward()
    return [parameter.grad.clone() for parameter in model.parameters()]


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def test_the_layers_train_eagerly_until_the_thread_has_compiled_then_on_its_graph(fresh_dynamo):
    model = tiny_model()
    compile_layers(model, backend="eager", beside=True)
    layers = model.model.layers
    beside = CompiledBeside.of(layers[0])
    ids = torch.randint(0, 40, (4, 20))
    eager = gradients(model, ids)  # starts the thread on a copy of the first layer's inputs
    assert beside.thread is not None and not beside.use_compiled
    beside.thread.join()
    assert beside.error is None
    assert fresh_dynamo["stats"]["unique_graphs"] == 1  # traced by the thread
    compiled = gradients(model, ids)
    assert beside.use_compiled and CompiledBeside.of(layers[0]) is None
    assert all(layer._compiled_call_impl is beside.compiled[i] for i, layer in enumerate(layers))
    assert fresh_dynamo["stats"]["unique_graphs"] == 1  # the training thread traced nothing
    for expected, got in zip(eager, compiled):
        torch.testing.assert_close(got, expected)
    gradients(model, torch.randint(0, 40, (3, 27)))  # another size and length: the same graph
    assert fresh_dynamo["stats"]["unique_graphs"] == 1


def test_a_layer_recomputed_in_the_backward_pass_runs_as_it_ran_forward(fresh_dynamo):
    model = tiny_model(gradient_checkpointing=True)
    compile_layers(model, backend="eager", beside=True)
    beside = CompiledBeside.of(model.model.layers[0])
    ids = torch.randint(0, 40, (2, 16))
    loss = model(input_ids=ids).logits.square().mean()
    beside.thread.join()
    loss.backward()  # recomputes every layer, the first last: still eagerly
    assert not beside.use_compiled
    gradients(model, ids)
    assert beside.use_compiled


def test_a_pass_without_gradients_starts_nothing(fresh_dynamo):
    model = tiny_model()
    compile_layers(model, backend="eager", beside=True)
    beside = CompiledBeside.of(model.model.layers[0])
    with torch.no_grad():
        model(input_ids=torch.randint(0, 40, (2, 8)))
    assert beside.thread is None and fresh_dynamo["stats"]["unique_graphs"] == 0


def test_sharded_layers_compile_on_their_first_call(fresh_dynamo, monkeypatch):
    monkeypatch.setattr(background_compile, "_sharded", lambda layer: True)
    model = tiny_model()
    compile_layers(model, backend="eager", beside=True)
    beside = CompiledBeside.of(model.model.layers[0])
    gradients(model, torch.randint(0, 40, (2, 8)))
    assert beside.thread is None and beside.use_compiled
    assert fresh_dynamo["stats"]["unique_graphs"] == 1


def failing_backend(graph, example_inputs):
    raise RuntimeError("no compiler here")


def test_a_given_compile_that_fails_in_the_thread_raises_at_the_next_pass(fresh_dynamo):
    model = tiny_model()
    compile_layers(model, backend=failing_backend, beside=True)
    beside = CompiledBeside.of(model.model.layers[0])
    ids = torch.randint(0, 40, (2, 8))
    gradients(model, ids)
    beside.thread.join()
    with pytest.raises(
        RuntimeError, match=r"(?s)torch_compile: compiling the decoder layers failed: .*no compiler here"
    ):
        gradients(model, ids)


def test_a_chosen_compile_that_fails_in_the_thread_trains_uncompiled_with_one_line(caplog):
    model = tiny_model()
    layers = model.model.layers

    def failing(*args, **kwargs):
        raise RuntimeError("no compiler here")

    beside = CompiledBeside(layers, [failing] * len(layers), fallback=True)
    ids = torch.randint(0, 40, (2, 8))
    eager = gradients(model, ids)
    beside.thread.join()
    with caplog.at_level(logging.WARNING, logger="grpoflow.policy.compiling"):
        again = gradients(model, ids)
        gradients(model, ids)
    assert [record.getMessage() for record in caplog.records] == [
        "compiling the decoder layers failed (no compiler here): training uncompiled"
    ]
    assert all(layer._compiled_call_impl is None for layer in layers)
    for expected, got in zip(eager, again):
        torch.testing.assert_close(got, expected)


def test_a_loaded_policy_given_torch_compile_compiles_its_layers_beside_training():
    from grpoflow.policy.loading import PolicyConfig, load_model

    model = load_model(
        "tiny",
        PolicyConfig(model="tiny", torch_compile=True),
        vocab_size=40,
        seed=0,
        device="cpu",
        dtype="auto",
    )
    assert all(CompiledBeside.of(layer) is not None for layer in model.model.layers)


def test_layers_whose_input_needs_no_gradient_still_compile_beside_training(fresh_dynamo):
    model = tiny_model()
    model.get_input_embeddings().requires_grad_(False)  # the first layer's input needs no gradient
    compile_layers(model, backend="eager", beside=True)
    beside = CompiledBeside.of(model.model.layers[0])
    ids = torch.randint(0, 40, (2, 8))
    trained = [p for p in model.parameters() if p.requires_grad]
    model(input_ids=ids).logits.square().mean().backward()
    assert beside.thread is not None
    beside.thread.join()
    assert beside.error is None
    model.zero_grad()
    model(input_ids=ids).logits.square().mean().backward()
    # the later layers' inputs need gradients, the first's not: a graph each, as compiled in place
    # (`trace_every_layer_alike` makes them alike in a run)
    assert beside.use_compiled and fresh_dynamo["stats"]["unique_graphs"] == 2
    assert all(p.grad is not None for p in trained)
