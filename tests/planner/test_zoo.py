"""The zoo's contract: deterministic builds, a working training step, and the fx traceability we rely on."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from planner.zoo import FIDELITY_ZOO, ZOO, SignGatedLinear, build_model

UNTRACEABLE = "untraceable_mlp"
TRACEABLE = [name for name in ZOO if name != UNTRACEABLE]


def run_training_step(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    output = model(*inputs)
    output.float().square().mean().backward()
    return output


class GatedLeafTracer(fx.Tracer):
    """Treats `SignGatedLinear` as an opaque leaf, as the capture fallback does."""

    def is_leaf_module(self, module: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(module, SignGatedLinear) or super().is_leaf_module(module, module_qualified_name)


def contains_gated_linear(module: nn.Module) -> bool:
    return any(isinstance(submodule, SignGatedLinear) for submodule in module.modules())


def test_entries_are_keyed_by_their_names() -> None:
    assert all(name == entry.name for name, entry in ZOO.items())


@pytest.mark.parametrize("name", ZOO)
def test_build_is_deterministic_and_leaves_global_rng_alone(name: str) -> None:
    rng_state = torch.get_rng_state()
    first_model, first_inputs = build_model(name)
    second_model, second_inputs = build_model(name)
    assert torch.equal(rng_state, torch.get_rng_state()), f"{name}: build() consumed the global RNG"

    first_state, second_state = first_model.state_dict(), second_model.state_dict()
    assert first_state.keys() == second_state.keys()
    for key, tensor in first_state.items():
        assert torch.equal(tensor, second_state[key]), f"{name}: {key} differs between builds"
    assert len(first_inputs) == len(second_inputs)
    for index, (first, second) in enumerate(zip(first_inputs, second_inputs, strict=True)):
        assert torch.equal(first, second), f"{name}: input {index} differs between builds"
        assert first is not second, f"{name}: input {index} is shared between builds"


@pytest.mark.parametrize("name", ZOO)
def test_training_step_gives_finite_gradients(name: str) -> None:
    model, inputs = build_model(name)
    assert all(module.training for module in model.modules()), f"{name}: not built in train mode"

    run_training_step(model, inputs)

    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"{name}: {parameter_name} got no gradient"
        assert torch.isfinite(parameter.grad).all(), f"{name}: {parameter_name} has a non-finite gradient"
    for index, tensor in enumerate(inputs):
        if tensor.requires_grad:
            assert tensor.grad is not None and torch.isfinite(tensor.grad).all(), f"{name}: input {index}"


@pytest.mark.parametrize("name", TRACEABLE)
def test_symbolic_trace_matches_eager(name: str) -> None:
    model, inputs = build_model(name)
    traced = fx.symbolic_trace(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        eager_output = model(*inputs)
        torch.manual_seed(1)
        traced_output = traced(*inputs)
    assert torch.equal(eager_output, traced_output), f"{name}: traced output differs from eager"


def test_untraceable_mlp_fails_whole_but_traces_around_its_gated_module() -> None:
    model, inputs = build_model(UNTRACEABLE)
    with pytest.raises(fx.proxy.TraceError):
        fx.symbolic_trace(model)

    graph = GatedLeafTracer().trace(model)
    traced = fx.GraphModule(model, graph)
    assert torch.equal(traced(*inputs), model(*inputs))
    traceable_modules = [module for module in model.modules() if not contains_gated_linear(module)]
    assert traceable_modules, "expected submodules besides the gated one"
    for module in traceable_modules:
        assert isinstance(fx.symbolic_trace(module), fx.GraphModule)


def test_fidelity_zoo_is_every_model_without_checkpoint_calls() -> None:
    assert set(FIDELITY_ZOO) == set(ZOO) - {"seed001_cnn_checkpointed"}


def test_unknown_name_raises_key_error_listing_valid_names() -> None:
    with pytest.raises(KeyError) as raised:
        build_model("nope")
    message = str(raised.value)
    assert "nope" in message
    assert all(name in message for name in ZOO), message
