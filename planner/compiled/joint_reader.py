"""One pass over AOT autograd's joint graph: the storages it makes, which are parameters and inputs, which
forward values the partition without checkpointing saves, what each kernel reads, forward and backward
(NOTE [fusion model] in fusion.py), and the channels-last copies inductor makes (NOTE [layout copies] in
joint_graph.py).

Why it exists: joint_graph.py builds the planner's nodes from this reading and backward_order.py walks
the backward over it; both read it, so it stands apart from both, and neither imports the other to
reach it (split from joint_graph.py, issue 36).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import fx
from torch._functorch.partitioners import NodeInfo, get_default_op_list

from planner.compiled.fusion import FusionModel, Storages, addmm_folds, is_primal, node_tensor
from planner.compiled.groups import hoisted_operators, step_constants
from planner.compiled.kernel_scratch import scratch_bytes
from planner.profiler.counting import counted_bytes

__all__ = ["JointReader"]


def _layout_optimised(joint: fx.GraphModule) -> bool:
    """Whether inductor runs `joint`'s convolutions in channels-last (NOTE [layout copies] in
    joint_graph.py)."""
    from torch._inductor.graph import GraphLowering

    return bool(GraphLowering.decide_layout_opt(joint, is_inference=False))


def _layout_copies(forward: Sequence[fx.Node], storages: Storages) -> dict[str, str]:
    """NOTE [layout copies] in joint_graph.py: storage of each parameter or input a convolution reads
    that inductor copies to channels-last -> the copy's storage name (sized in `storages`)."""
    copies: dict[str, str] = {}
    for node in forward:
        if node.target is not torch.ops.aten.convolution.default:
            continue
        for source in node.args[:2]:
            if not isinstance(source, fx.Node) or source.op != "placeholder":
                continue
            value = node_tensor(source)
            if value is None or value.dim() != 4:
                continue
            if value.is_contiguous(memory_format=torch.channels_last):
                continue
            name = storages.name(source)
            if name is not None and name not in copies:
                copies[name] = f"{name}.channels_last"
                storages.sizes[copies[name]] = counted_bytes(value.untyped_storage().nbytes())
                storages.dtypes[copies[name]] = value.dtype
    return copies


class JointReader:
    """One pass over a joint graph: storages, groups, what each group's backward reads, liveness."""

    def __init__(
        self,
        joint: fx.GraphModule,
        node_info: NodeInfo,
        default_saved: Iterable[fx.Node],
        num_fwd_outputs: int,
    ) -> None:
        self.op_types = get_default_op_list()
        self.storages = Storages(self.op_types)
        nodes = list(joint.graph.nodes)
        named = {node: self.storages.name(node) for node in nodes}  # in graph order: producers first
        self.static_storages = {name for node, name in named.items() if is_primal(node) and name is not None}
        self.forward = [n for n in nodes if n.op == "call_function" and node_info.is_required_fw(n)]
        self.hoisted = hoisted_operators(self.forward, default_saved)
        self.forward_set = {*self.forward, *self.hoisted}
        self.backward = [n for n in nodes if n.op == "call_function" and n not in self.forward_set]
        self.backward_set = set(self.backward)
        output = next(n for n in nodes if n.op == "output")
        values = [value for value in output.args[0] if isinstance(value, fx.Node)]
        self.forward_outputs = set(output.args[0][:num_fwd_outputs]) - {None}
        primals = [node for node in nodes if is_primal(node)]
        gradients_of_primals = output.args[0][num_fwd_outputs:]
        with_gradient = [p for p, g in zip(primals, gradients_of_primals, strict=True) if g is not None]
        self.step_constants = step_constants(self.forward, with_gradient, self.op_types)
        """NOTE [step constants] in groups.py."""
        self.gradients = set(values) - self.forward_outputs
        self.tangents = [n for n in nodes if n.op == "placeholder" and not is_primal(n)]
        self.gradient_dependent = set(node_info.tangents_closure)
        self.tangent_storages = {
            name for node in self.tangents if (name := self.storages.name(node)) is not None
        }
        channels_last = _layout_optimised(joint)
        self.layout_copies = _layout_copies(self.forward, self.storages) if channels_last else {}
        self.scratch_bytes = scratch_bytes((*self.forward, *self.backward), channels_last=channels_last)
        """NOTE [kernel scratch]: bytes an extern kernel holds above its outputs while it runs."""
        self.saved_storages = self._activation_storages(default_saved) | set(self.layout_copies.values())
        self.output_storages = self._activation_storages(self.forward_outputs)
        self.releasable_saved = self.saved_storages - self.output_storages
        """Saved storages the backward may free or reuse once read: not those the forward also returns
        (NOTE [saved outputs] in backward_order.py)."""
        self._saved_closure: dict[fx.Node, frozenset[str]] = {}
        pinned = set(self.step_constants)
        read_constants = self._activation_storages(
            node for node in pinned if any(user not in pinned for user in node.users)
        )
        kept = self.saved_storages | self.output_storages | read_constants
        self.forward_fusion = FusionModel(
            [n for n in nodes if n in self.forward_set],
            self.op_types,
            self.storages.name,
            self._placeholder_storage,
            lambda node: self.activation(node) in kept and self.made_here(node) is not None,
        )
        self.backward_fusion = FusionModel(
            self.backward,
            self.op_types,
            self.storages.name,
            lambda node: (
                self.saved_reads(node) if node in self.forward_set else self._placeholder_storage(node)
            ),
            lambda node: node in self.gradients,
            addmm_folds(self.backward),
        )

    def _placeholder_storage(self, node: fx.Node) -> frozenset[str]:
        """A parameter or input as kernels read it: its channels-last copy where inductor makes one."""
        name = self.storages.name(node) if node.op == "placeholder" else None
        if name is None:
            return frozenset()
        return frozenset({self.layout_copies.get(name, name)})

    def _activation_storages(self, nodes: Iterable[fx.Node]) -> set[str]:
        names = {self.storages.name(node) for node in nodes if isinstance(node, fx.Node)}
        return {name for name in names if name is not None and name not in self.static_storages}

    def activation(self, node: fx.Node) -> str | None:
        """The activation storage of a forward value (None for parameters, inputs and non-tensors)."""
        name = self.storages.name(node)
        return None if name is None or name in self.static_storages else name

    def made_here(self, node: fx.Node) -> str | None:
        """The storage `node` allocates, if it allocates one (not a view of another value's)."""
        name = self.activation(node)
        return name if name is not None and self.storages.producer[name] is node else None

    def forward_materialized(self, name: str) -> bool:
        return self.storages.producer[name] in self.forward_fusion.materialized

    def reads(self, node: fx.Node) -> frozenset[str]:
        """Activation storages the kernel computing `node` reads (NOTE [fusion model] in
        fusion.py): a value computed inside the kernel contributes what it reads in turn."""
        return frozenset(
            name for name in self.forward_fusion.inlined_reads[node] if name not in self.static_storages
        )

    def saved_reads(self, node: fx.Node) -> frozenset[str]:
        """Saved storages (of the partition without checkpointing) a backward use of `node` needs: its
        storage when saved (a view of a saved value reads its base), else, for a forward value, what
        recomputing it reads; nothing for a value the backward made."""
        if node in self._saved_closure:
            return self._saved_closure[node]
        name = self.activation(node)
        if name is None:
            found: frozenset[str] = frozenset()
        elif name in self.saved_storages:
            found = frozenset({name})
        elif node not in self.forward_set:
            found = frozenset()
        else:
            found = frozenset().union(*(self.saved_reads(source) for source in node.all_input_nodes))
        self._saved_closure[node] = found
        return found

    def backward_buffer(self, node: fx.Node) -> str | None:
        """The buffer a backward node (or a tangent) allocates, per NOTE [fusion model]; None when it
        computes inside another kernel, is a view, or is not a tensor."""
        name = self.storages.name(node)
        if name is None or self.storages.producer[name] is not node:
            return None
        if node.op == "placeholder" or node in self.backward_fusion.materialized:
            return name
        return None
