"""The hand methods of planner/testing/hand_methods.py are what they claim: each gives the model's loss
and gradients after one step, checkpoints something (a lower measured peak), and one that does not
apply says why. Unlike `plan.module`, a hand method replays BatchNorm's forward, so running statistics
move twice per step: the benches compare peers' gradients only (`gradient_mismatch`), and so do these.
Which of them beat the planner is tests/planner/test_every_instance.py's.

The own switches are tried on a Hugging Face GPT-2 and zoo_real's diffusers `UNet2DModel`, built from
a config with random weights (diffusers is in the dev extra); timm is not installed here (pyproject.toml says
why), so its `set_grad_checkpointing` is run by the benches only where timm is.
"""

from __future__ import annotations

import copy

import planner
from planner.testing.hand_methods import (
    EVERY_BLOCK,
    OWN_SWITCH,
    SQRT_SEGMENTS,
    every_block,
    every_instance_name,
    hand_methods,
    own_switch,
    sqrt_segments,
)
from planner.testing.steps import assert_same_step, buffer_mismatch, gradient_mismatch, one_step
from planner.testing.zoo_real import build_call

GRADIENT_RTOL = 1e-5


def test_the_diffusers_switch_checkpoints_and_trains_as_the_model() -> None:
    call = build_call("diffusers_unet")
    model, inputs = call.model, call.args
    switch = own_switch(model)
    assert switch.variant is not None, switch.description
    assert "enable_gradient_checkpointing" in switch.description
    assert_same_step(one_step(model, inputs), one_step(switch.variant, inputs), rtol=GRADIENT_RTOL)
    unchanged = planner.measure(copy.deepcopy(model), inputs).peak_bytes
    assert planner.measure(switch.variant.module, inputs).peak_bytes < unchanged


def test_a_hugging_face_model_gets_its_switch_and_every_repeated_type() -> None:
    call = build_call("hf_gpt2")
    methods = {method.name: method for method in hand_methods(call.model, call.args, kwargs=call.kwargs)}
    assert {OWN_SWITCH, "every GPT2Block", "every GPT2MLP"} <= set(methods), sorted(methods)
    assert "activation_checkpointing_enable" in methods[OWN_SWITCH].description
    assert SQRT_SEGMENTS not in methods, "two layers are no stack to cut in segments"
    reference = one_step(call.model, call.args, kwargs=call.kwargs)
    for name in (OWN_SWITCH, "every GPT2Block"):
        variant = methods[name].variant
        assert variant is not None
        assert_same_step(reference, one_step(variant, call.args, kwargs=call.kwargs), rtol=GRADIENT_RTOL)


def test_the_segments_and_blocks_of_a_cnn_and_a_switch_it_lacks() -> None:
    call = build_call("resnet")
    segments = sqrt_segments(call.model, call.args)
    assert segments.variant is not None and "checkpoint_sequential over Sequential blocks" in (
        segments.description
    )
    blocks = every_block(call.model)
    assert blocks.name == EVERY_BLOCK and blocks.variant is not None
    reference = one_step(call.model, call.args)
    for method in (segments, blocks):
        assert method.variant is not None
        step = one_step(method.variant, call.args)
        assert gradient_mismatch(reference, step, rtol=GRADIENT_RTOL) is None, method.name
        assert buffer_mismatch(reference, step) is not None, (
            f"{method.name}: BatchNorm replayed, yet stats equal"
        )
    missing = own_switch(call.model)
    assert missing.variant is None and "has no gradient_checkpointing_enable" in missing.description
    names = [method.name for method in hand_methods(call.model, call.args)]
    assert every_instance_name(type(call.model.blocks[0])) in names and OWN_SWITCH not in names, names


def test_a_layer_shared_across_depth_is_checkpointed_at_every_call() -> None:
    """ALBERT runs one `AlbertLayer` (one instance) four times: no type of it has two instances, yet a
    user checkpoints that layer by hand, every call of it, and measures far less. "every AlbertLayer" is
    a hand method (`shared_module_types`), trains as the model and measures below it."""
    call = build_call("hf_albert")
    methods = {method.name: method for method in hand_methods(call.model, call.args, kwargs=call.kwargs)}
    shared = methods.get("every AlbertLayer")
    assert shared is not None and shared.variant is not None, sorted(methods)
    reference = one_step(call.model, call.args, kwargs=call.kwargs)
    assert_same_step(reference, one_step(shared.variant, call.args, kwargs=call.kwargs), rtol=GRADIENT_RTOL)
    unchanged = planner.measure(copy.deepcopy(call.model), call.args, example_kwargs=call.kwargs).peak_bytes
    checkpointed = planner.measure(shared.variant.module, call.args, example_kwargs=call.kwargs).peak_bytes
    assert checkpointed < 0.6 * unchanged, (checkpointed, unchanged)
