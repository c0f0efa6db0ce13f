"""Calls the capture could not follow (a block with hooks, a forward with Python control flow) are planned
at the level of their children: a plan checkpoints one child call, or the whole call, never a run that
cuts the call's own Python code (NOTE [split calls] in planner/simulation/step.py)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import planner
from planner.ir import GLUE_OP, ActivationGraph, Node, Region, RegionPolicy, Schedule
from planner.simulation.step import CheckpointRule, simulate
from planner.solvers import solve
from planner.testing.hand_methods import hand_methods
from planner.testing.steps import assert_same_step, one_step
from planner.testing.synthetic_graphs import all_schedules, random_dag, with_split_call
from planner.testing.zoo_dag import InlineMoEBlock
from planner.testing.zoo_real import build_call

SPLIT_DAGS = {
    f"split-dag-{seed}": with_split_call(random_dag(random.Random(seed), 7), 2, 7) for seed in range(4)
}


def test_a_checkpointed_region_takes_a_split_call_whole_or_one_child_call() -> None:
    graph = SPLIT_DAGS["split-dag-0"]  # nodes 2..6: glue, child, glue, child, glue
    rule = CheckpointRule.of(graph)
    assert rule.allows(graph, 3, 4) and rule.allows(graph, 5, 6), "one child call"
    assert rule.allows(graph, 2, 7) and rule.allows(graph, 0, 7), "the whole call, alone or with others"
    assert not rule.allows(graph, 2, 3), "glue alone cuts the call's code"
    assert not rule.allows(graph, 3, 6), "two children and the glue between them"
    assert not rule.allows(graph, 0, 4), "a region ending inside the call"
    assert not rule.allows(graph, 4, 5), "glue between children"


@pytest.mark.parametrize("solver", ["dp", "ilp"])
@pytest.mark.parametrize("name", sorted(SPLIT_DAGS))
def test_least_recompute_with_a_split_call_is_the_brute_force_optimum(name: str, solver: str) -> None:
    graph = SPLIT_DAGS[name]
    results = [simulate(graph, schedule) for schedule in all_schedules(graph)]
    lowest = min(result.peak_bytes for result in results)
    highest = max(result.peak_bytes for result in results)
    for fraction in (0.0, 0.3):
        budget = lowest + int(fraction * (highest - lowest))
        oracle_ms = min(result.recompute_ms for result in results if result.peak_bytes <= budget)
        planned = simulate(graph, solve(graph, budget_bytes=budget, solver=solver))
        assert planned.peak_bytes <= budget
        assert planned.recompute_ms == pytest.approx(oracle_ms, abs=1e-9), f"budget {budget}"


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class ClampedBlock(Block):
    """Python control flow on a tensor's value (FX cannot trace it), which never changes which children
    run or their shapes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        if y.abs().max() > 1e3:
            y = y / y.abs().max()
        return x + self.dropout(y)


class Stack(nn.Module):
    def __init__(self, block: type[Block], width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(width) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def counted_calls(model: nn.Module, path: str) -> list[int]:
    """A forward hook on `path` that counts its calls (a hook makes FX keep the module whole)."""
    calls = [0]
    model.get_submodule(path).register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def lowest_plan(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> planner.Plan:
    reference = planner.optimize(model, inputs, budget_bytes=2**40, solver="dp")
    return reference.replan(budget_bytes=reference.min_peak_bytes, solver="dp")


def assert_fits_and_trains_alike(
    plan: planner.Plan, model: nn.Module, inputs: tuple[torch.Tensor, ...]
) -> None:
    measured = planner.measure(copy.deepcopy(plan.module), inputs)
    assert measured.peak_bytes <= plan.budget_bytes, plan.summary()
    assert abs(plan.predicted_peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes
    assert_same_step(one_step(model, inputs), one_step(plan.module, inputs))


def every_child_call(graph: ActivationGraph) -> Schedule:
    """Each child call of every split call in a checkpoint of its own, the rest stored."""
    rule = CheckpointRule.of(graph)
    regions = [
        Region(
            index,
            index + 1,
            RegionPolicy.CHECKPOINT
            if node.part_of and rule.allows(graph, index, index + 1) and node.op != GLUE_OP
            else RegionPolicy.STORE,
        )
        for index, node in enumerate(graph.nodes)
    ]
    return Schedule(regions=tuple(regions), solver="every child call")


def assert_child_calls_checkpoint_as_predicted(
    plan: planner.Plan, model: nn.Module, inputs: tuple[torch.Tensor, ...]
) -> None:
    schedule = every_child_call(plan.graph)
    assert schedule.checkpointed, "no child call to checkpoint"
    assert plan.profile is not None
    module = plan.profile.rewrite(schedule)
    predicted = simulate(plan.graph, schedule).peak_bytes
    measured = planner.measure(copy.deepcopy(module), inputs).peak_bytes
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)
    assert_same_step(one_step(model, inputs), one_step(module, inputs))


def test_children_of_a_block_with_hooks_are_checkpointed_and_its_hook_runs_once() -> None:
    torch.manual_seed(0)
    model = Stack(Block)
    calls = counted_calls(model, "blocks.1")
    inputs = (torch.randn(64, 16, 64),)
    plan = lowest_plan(model, inputs)
    assert "planned by children: blocks.1" in plan.capture
    assert_fits_and_trains_alike(plan, model, inputs)
    assert_child_calls_checkpoint_as_predicted(plan, model, inputs)
    before = calls[0]
    plan.module.train()
    planner.measure(copy.deepcopy(plan.module), inputs)  # two training steps
    assert calls[0] - before == 2, "the hooked block's forward hook runs once per step, replays included"


def test_a_forward_with_control_flow_that_calls_the_same_children_is_planned_by_them() -> None:
    torch.manual_seed(0)
    model = Stack(ClampedBlock)
    inputs = (torch.randn(64, 16, 64),)
    plan = lowest_plan(model, inputs)
    assert plan.capture.startswith("fx (planned by children: blocks.0, blocks.1, blocks.2, blocks.3")
    assert_fits_and_trains_alike(plan, model, inputs)
    assert_child_calls_checkpoint_as_predicted(plan, model, inputs)


def parts(graph: ActivationGraph) -> list[str]:
    return [node.name for node in graph.nodes if node.part_of]


def test_children_called_by_the_data_stay_inside_one_node() -> None:
    call = build_call("moe_transformer")
    plan = planner.optimize(call.model, call.args, budget_bytes=2**40, solver="dp")
    assert "opaque: blocks.0.mixture" in plan.capture and "planned by children" not in plan.capture
    assert not parts(plan.graph), "a top-2 router's experts see other token counts at every step"


def test_glue_is_recorded_with_what_it_keeps_alive() -> None:
    torch.manual_seed(0)
    model = Stack(ClampedBlock, depth=2)
    plan = planner.optimize(model, (torch.randn(8, 4, 64),), budget_bytes=2**40, solver="dp")
    graph = plan.graph
    glue = [node for node in graph.nodes if node.op == GLUE_OP]
    children = [node for node in graph.nodes if node.part_of and node.op != GLUE_OP]
    assert [node.module_path for node in children[:4]] == [
        "blocks.0.norm",
        "blocks.0.up",
        "blocks.0.down",
        "blocks.0.dropout",
    ]
    assert len(glue) == len(children) + 2, "glue before, between and after the children of each call"
    assert all(node.checkpointable for node in graph.nodes if node.part_of)


def in_unit(node: Node, path: str) -> bool:
    return node.module_path == path or node.module_path.startswith(f"{path}.")


def only_unit_checkpointed(graph: ActivationGraph, path: str) -> Schedule:
    """The unit at `path` checkpointed whole (every part of its call: NOTE [nested units] in
    planner/profiler/split_calls.py), the rest stored."""
    inside = [index for index, node in enumerate(graph.nodes) if in_unit(node, path)]
    start, stop = inside[0], inside[-1] + 1
    assert inside == list(range(start, stop)), inside
    schedule = Schedule(
        regions=(
            Region(0, start, RegionPolicy.STORE),
            Region(start, stop, RegionPolicy.CHECKPOINT),
            Region(stop, len(graph.nodes), RegionPolicy.STORE),
        ),
        solver="test",
    )
    return schedule


def assert_unit_checkpointed_exactly(
    plan: planner.Plan, model: nn.Module, inputs: tuple[torch.Tensor, ...], path: str, *, forward: bool = True
) -> None:
    """With only the unit at `path` checkpointed, the step's peak (and with `forward`, the forward's) is
    predicted to the byte, and it trains as the model does."""
    schedule = only_unit_checkpointed(plan.graph, path)
    assert plan.profile is not None
    module = plan.profile.rewrite(schedule)
    measured = planner.measure(copy.deepcopy(module), inputs)
    predicted = simulate(plan.graph, schedule)
    forward_bytes = max(step.live_bytes for step in predicted.trace if step.phase.value == "forward")
    assert forward_bytes == measured.phase_peak_bytes["forward"] or not forward, path
    assert predicted.peak_bytes == measured.peak_bytes, path
    assert_same_step(one_step(model, inputs), one_step(module, inputs))


class Projection(nn.Module):
    """Returns its output and its normalised input, as wav2vec2's feature projection does."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.norm(x)
        return self.linear(normed), normed


class BranchingHead(nn.Module):
    """Two blocks and a head behind a branch on a value (no trace captures it: planned by its children)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, 8)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.head(hidden)
        if logits.abs().max() > 1e3:
            logits = logits / logits.abs().max()
        return logits.log_softmax(-1)


class HoldsWhatItIgnores(BranchingHead):
    """A root that keeps the projection's whole output until it returns, reading only its first field."""

    def __init__(self, width: int = 64) -> None:
        super().__init__(width)
        self.projection = Projection(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.projection(x)
        return self.finish(projected[0])


def test_a_child_output_the_caller_holds_unread_is_held_until_the_call_returns() -> None:
    """NOTE [outputs the caller holds] in planner/profiler/split_calls.py: with the projection
    checkpointed, its unread second output lives until the root returns (the root's local holds it),
    where it was predicted freed at once: the forward's peak 64 KiB below its measurement."""
    torch.manual_seed(0)
    model, inputs = HoldsWhatItIgnores(), (torch.randn(16, 16, 64),)
    plan = planner.optimize(model, inputs, budget_bytes=2**40, solver="dp")
    assert plan.capture == "module", plan.capture
    assert_unit_checkpointed_exactly(plan, model, inputs, "projection")


class DropsItsInput(BranchingHead):
    """A root whose own code drops the normalised input once dropout has read it (rebinding `hidden`, as
    wav2vec2's encoder does before its first layer)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__(width)
        self.norm = nn.LayerNorm(width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(x)
        hidden = self.dropout(hidden)
        return self.finish(hidden)


def test_what_the_glue_drops_after_a_child_call_is_not_read_by_the_next_child() -> None:
    """NOTE [the child's arguments] in planner/profiler/split_calls.py: the profiler kept the dropout's
    arguments until the first block's call began, so the normalised input the root's code drops was
    recorded as read by that block; with the block checkpointed, the plan held it as the block's input
    until the block's backward, and wav2vec2's plans were predicted up to 162,816 B (1.6 %) above their
    measurement. The glue between the two calls reads it now, and the step's peak is exact."""
    torch.manual_seed(0)
    model, inputs = DropsItsInput(), (torch.randn(16, 16, 64),)
    plan = planner.optimize(model, inputs, budget_bytes=2**40, solver="dp")
    assert plan.capture == "module", plan.capture
    (normalised,) = (node.creates for node in plan.graph.nodes if node.module_path == "norm")
    block_reads = {name for node in plan.graph.nodes if in_unit(node, "blocks.0") for name in node.reads}
    assert not set(normalised) & block_reads, "the block reads only its argument"
    assert_unit_checkpointed_exactly(plan, model, inputs, "blocks.0")


class AttentionBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU())
        self.out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm(x)
        x = x + self.attention(normed, normed, normed, need_weights=False)[0]
        return x + self.out(self.mlp(x))


class BlocksBehindABranch(nn.Module):
    """Blocks whose attention holds most of their activations, behind a root that branches on a value
    (no trace captures it: planned by its submodules, as BLOOM is)."""

    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(AttentionBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        if hidden.abs().max() > 1e3:
            hidden = hidden / hidden.abs().max()
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden).log_softmax(-1)


def test_a_plan_by_submodules_checkpoints_a_blocks_child_or_the_whole_block() -> None:
    """NOTE [nested units] in planner/profiler/split_calls.py: at the module level each block's call is
    split at its children, so a plan may checkpoint one attention in a block, or the block whole, and
    our lowest is no higher than any hand method's measured peak (on BLOOM, `checkpoint_wrapper` on
    every attention measured 3.23 MiB against our lowest 3.36 when blocks were whole units). Either
    kind of region is predicted to the byte and trains as the model does."""
    torch.manual_seed(0)
    model, inputs = BlocksBehindABranch(), (torch.randn(4, 64, 32),)
    reference = lowest_plan(model, inputs)
    assert reference.capture == "module", reference.capture
    paths = {node.module_path for node in reference.graph.nodes}
    assert {"blocks.0", "blocks.0.attention", "blocks.1.mlp.1"} <= paths, sorted(paths)
    for method in hand_methods(model, inputs):
        assert method.variant is not None
        hand_bytes = planner.measure(copy.deepcopy(method.variant.module), inputs).peak_bytes
        assert reference.predicted_peak_bytes <= hand_bytes, (method.name, hand_bytes, reference.summary())
    # a checkpointed nn.MultiheadAttention's forward is predicted as profiled, its intermediates held
    # until it returns: 128 KiB above its measurement there, an upper bound below the step's peak
    for path in ("blocks.0", "blocks.1.attention"):
        assert_unit_checkpointed_exactly(reference, model, inputs, path, forward=False)
    assert_fits_and_trains_alike(reference, model, inputs)


class RareLayerDrop(nn.Module):
    """Two residual layers each skipped with probability 0.1 (LayerDrop, as wav2vec2 draws it), behind a
    root that branches on a value (planned by its submodules)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(2)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 1e3:
            x = x / x.abs().max()
        for layer in self.layers:
            if self.training and torch.rand(()) < 0.1:
                continue
            x = x + layer(x)
        return self.head(x)


@pytest.mark.parametrize("seed", range(4))
def test_layers_skipped_at_random_are_refused_whatever_the_probe_drew(seed: int) -> None:
    """NOTE [layers called at random] in planner/planning/model.py: the probe's three forwards often draw
    the same layers, and the model was then planned (under 10 of 12 seeds before, these four among
    them) for a step that the next one does not repeat; every plan by submodules is checked now."""
    torch.manual_seed(seed)
    model, inputs = RareLayerDrop(), (torch.randn(8, 32),)
    with pytest.raises(planner.UnsupportedModel, match="layerdrop = 0.0"):
        planner.optimize(model, inputs, budget_bytes=2**40)


class RoutedBehindABranch(nn.Module):
    """Blocks that route tokens to experts by value (children called depending on the data), behind a
    root that branches on a value (planned by its submodules)."""

    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(InlineMoEBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 1e3:
            x = x / x.abs().max()
        for block in self.blocks:
            x = block(x)
        return self.head(x).log_softmax(-1)


def test_a_block_whose_children_follow_the_data_stays_one_unit() -> None:
    """NOTE [nested units]: a block that routes tokens to its experts by value calls other experts on other
    inputs, so its call is not split (checkpointing one expert would move bytes with the routing);
    the block stays one unit, checkpointed whole, and the lowest plan fits and trains as the model."""
    torch.manual_seed(0)
    model, inputs = RoutedBehindABranch(), (torch.randn(4, 16, 32),)
    plan = lowest_plan(model, inputs)
    assert plan.capture == "module", plan.capture
    blocks = [node.module_path for node in plan.graph.nodes if node.module_path.startswith("blocks.")]
    assert blocks == ["blocks.0", "blocks.1"], blocks
    assert plan.schedule.checkpointed, plan.summary()
    assert_fits_and_trains_alike(plan, model, inputs)
