"""Attention masks that a trace materialises and the model itself never makes, dropped from the graph.

Why it exists: the captured module must cost no more than the model it came from (issue 35), and an
exported transformer can: its attention masks are made of the call's sizes alone, skipped in eager and
materialised in the trace. `drop_size_only_masks` is a rewrite of an exported graph on its own, run by
the export level of the capture chain (chain.py).

NOTE [materialised masks]: Hugging Face's masking utilities skip a mask that masks nothing (a
bidirectional mask without padding: `attn_mask=None`) and pass a purely causal one as `is_causal=True`,
but only when not tracing; under torch.export they build it from `arange` and comparisons as a
[batch, 1, query, key] bool tensor. `scaled_dot_product_attention` on the CPU turns a bool mask into a
float one in every call and saves it for backward, so the captured module held one float mask per
attention layer more than the model: 135,200 bytes (two 4 x 1 x 65 x 65 masks) on zoo_real's `hf_vit`,
and a batch x sequence x sequence float32 tensor per layer on GPT-2. So, after export, each attention
mask that depends on no input's values, parameter or buffer (only on sizes, through `sym_size`) is
evaluated at the example's sizes and at two other sets of sizes: a bool mask that is all True at every
evaluation is dropped, and one that is the causal lower triangle of a square attention at every
evaluation becomes `is_causal=True`, as the model runs it in eager. Any other mask, and any mask an
input's values reach (a padding `attention_mask`), stays as traced. An additive float mask of zeros
stays too: the model makes such masks itself (T5's cross-attention adds its zero position bias to the
encoder's mask), and on a GPU attention with a mask may take another kernel, with other dropout draws,
than attention without one (NOTE [grouped heads]).

NOTE [grouped heads]: where Hugging Face passes no mask, it also lets attention repeat grouped key and
value heads itself (`enable_gqa=True`, `use_gqa_in_sdpa` in transformers' sdpa_attention.py: no mask and
equal head sizes of at most 256); with the mask a trace materialises, it repeats them first
(`repeat_kv`: unsqueeze, expand, reshape). Dropping the mask alone left the captured module calling
attention otherwise than the model: on an H100 zoo_real's Llama (attention dropout 0.1, 4 heads over 2
key-value heads) trained with another loss than the model's (bench/results/compare_cuda_eager.md), where
a GPU may take another attention kernel, with other dropout draws, for the other call. So where a mask
goes, repeated key and value heads go too, and the call gets `enable_gqa=True`, as in eager. (The two
calls compute the same values; on the CPU they also draw the same dropout.)
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

__all__ = ["drop_size_only_masks"]

ATTENTION = torch.ops.aten.scaled_dot_product_attention.default
"""The attention operator of an exported graph (training IR keeps it whole)."""
SIZE_OF = torch.ops.aten.sym_size.int
"""The only way an input may reach a mask that is dropped: through its size."""
MASK_ARGUMENT, IS_CAUSAL_ARGUMENT = 3, 5
"""Positions of `attn_mask` and `is_causal` in `scaled_dot_product_attention`'s schema."""
KEY_ARGUMENT, VALUE_ARGUMENT = 1, 2
RESHAPES = frozenset(
    {torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}
)
EXPAND, UNSQUEEZE = torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default
SLICE = torch.ops.aten.slice.Tensor
GROUPED_HEAD_SIZE_LIMIT = 256
"""The largest head size Hugging Face lets attention group heads at (NOTE [grouped heads])."""
SIZE_CHANGES: tuple[Callable[[int], int], ...] = (lambda size: size + 1, lambda size: 2 * size + 3)
"""The other sizes a mask is evaluated at, besides the example's: every symbolic size changed alike."""


def drop_size_only_masks(graph_module: fx.GraphModule, example_inputs: Iterable[Any]) -> int:
    """Drop, or turn into `is_causal=True`, the attention masks made of sizes alone (NOTE
    [materialised masks]); returns how many attention calls changed."""
    graph = graph_module.graph
    sizes = _placeholder_sizes(graph, list(example_inputs))
    dropped: set[fx.Node] = set()
    changed = 0
    for attention in list(graph.find_nodes(op="call_function", target=ATTENTION)):
        mask = _mask_of(attention)
        ancestors = None if mask is None or _is_causal(attention) else _ancestors(mask)
        if mask is None or ancestors is None:
            continue
        evaluations = _evaluations(ancestors, mask, sizes)
        if evaluations is None:
            continue
        if all(_masks_nothing(values) for values in evaluations):
            _replace_mask(attention, is_causal=False)
        elif all(_is_causal_triangle(values) for values in evaluations):
            _replace_mask(attention, is_causal=True)
        else:
            continue
        dropped.update(ancestors)
        dropped.update(_group_repeated_heads(attention))
        changed += 1
    if changed:
        _erase_unused(graph, dropped)
        graph_module.recompile()
    return changed


def _placeholder_sizes(graph: fx.Graph, example_inputs: list[Any]) -> dict[fx.Node, tuple[int, ...]]:
    """The example's shape of each tensor placeholder, in the graph's input order."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    return {
        node: tuple(value.shape)
        for node, value in zip(placeholders, example_inputs, strict=False)
        if isinstance(value, torch.Tensor)
    }


def _mask_of(attention: fx.Node) -> fx.Node | None:
    mask = attention.args[MASK_ARGUMENT] if len(attention.args) > MASK_ARGUMENT else None
    mask = attention.kwargs.get("attn_mask", mask)
    return mask if isinstance(mask, fx.Node) else None


def _is_causal(attention: fx.Node) -> bool:
    flag = attention.args[IS_CAUSAL_ARGUMENT] if len(attention.args) > IS_CAUSAL_ARGUMENT else False
    return bool(attention.kwargs.get("is_causal", flag))


def _ancestors(node: fx.Node) -> list[fx.Node] | None:
    """`node` and what it is computed from, in graph order; None when an input's values, a parameter,
    a buffer or a random operator reaches it."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op != "call_function":
            return None
        if current.target is SIZE_OF:
            continue  # its input is read for its size only
        if isinstance(current.target, torch._ops.OpOverload):
            if torch.Tag.nondeterministic_seeded in current.target.tags:
                return None
        elif current.target not in SIZE_ARITHMETIC:
            return None
        stack.extend(current.all_input_nodes)
    return [candidate for candidate in node.graph.nodes if candidate in seen]


SIZE_ARITHMETIC = frozenset(
    {operator.add, operator.sub, operator.mul, operator.floordiv, operator.neg, operator.getitem}
)
"""Python operators an exported graph computes sizes with."""


def _evaluations(
    ancestors: list[fx.Node], mask: fx.Node, sizes: Mapping[fx.Node, tuple[int, ...]]
) -> list[torch.Tensor] | None:
    """The mask's values at the example's sizes and at `SIZE_CHANGES` of them, computed on the CPU from
    its `ancestors`; None when they cannot be computed."""
    size_nodes = [node for node in ancestors if node.target is SIZE_OF]
    example: dict[fx.Node, int] = {}
    for node in size_nodes:
        size = _example_size(node, sizes)
        if size is None:
            return None
        example[node] = size
    symbols = _symbols(size_nodes, example)
    if symbols is None:
        return None
    settings: list[Callable[[int], int]] = [lambda size: size, *SIZE_CHANGES]
    evaluations = []
    for change in settings:
        values = example | {node: change(example_size) for node, example_size in symbols.items()}
        try:
            evaluations.append(_run(ancestors, mask, values))
        except Exception:  # noqa: BLE001 - a mask we cannot compute stays as traced
            return None
    return evaluations


def _example_size(node: fx.Node, sizes: Mapping[fx.Node, tuple[int, ...]]) -> int | None:
    tensor, dimension = node.args[0], node.args[1]
    if not isinstance(tensor, fx.Node) or tensor not in sizes or not isinstance(dimension, int):
        return None
    shape = sizes[tensor]
    return shape[dimension] if -len(shape) <= dimension < len(shape) else None


def _symbols(size_nodes: list[fx.Node], example: Mapping[fx.Node, int]) -> dict[fx.Node, int] | None:
    """Each size node whose size is symbolic, with its example size, provided that nodes of one symbol
    share one example size (so that changing every symbolic size alike keeps them equal) and that each
    is a bare symbol. A size the export specialised (an int, or a SymInt it made a constant: CLIP's
    batch, which its contrastive loss reads as `len(logits)`) is the same in every call of the graph;
    it keeps its example size."""
    by_symbol: dict[str, int] = {}
    symbols: dict[fx.Node, int] = {}
    for node in size_nodes:
        value = node.meta.get("val")
        size = example[node]
        if not isinstance(value, torch.SymInt) or is_concrete_int(value):
            continue
        name = str(value.node.expr)
        if not name.isidentifier() or by_symbol.setdefault(name, size) != size:
            return None
        symbols[node] = size
    return symbols


def _run(ancestors: list[fx.Node], mask: fx.Node, sizes: Mapping[fx.Node, int]) -> torch.Tensor:
    """The mask computed from `sizes`, every tensor on the CPU."""
    values: dict[fx.Node, Any] = {}
    for node in ancestors:
        if node.target is SIZE_OF:
            values[node] = sizes[node]
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda argument: values[argument])
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        assert callable(node.target)
        values[node] = node.target(*args, **kwargs)
    result = values[mask]
    assert isinstance(result, torch.Tensor)
    return result


def _masks_nothing(mask: torch.Tensor) -> bool:
    """A bool mask of all True (what a trace materialises for a mask the model skips)."""
    return mask.dtype == torch.bool and bool(mask.all())


def _is_causal_triangle(mask: torch.Tensor) -> bool:
    """A bool mask that lets each query attend to itself and the keys before it, in a square attention:
    what `is_causal=True` computes (its triangle is aligned to the top left)."""
    if mask.dtype != torch.bool or mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    size = mask.shape[-1]
    triangle = torch.ones(size, size, dtype=torch.bool).tril()
    return bool((mask == triangle).all())


def _replace_mask(attention: fx.Node, *, is_causal: bool) -> None:
    args = list(attention.args)
    kwargs = dict(attention.kwargs)
    if "attn_mask" in kwargs:
        kwargs["attn_mask"] = None
    else:
        args[MASK_ARGUMENT] = None
    if is_causal:
        if len(args) > IS_CAUSAL_ARGUMENT:
            args[IS_CAUSAL_ARGUMENT] = True
        else:
            kwargs["is_causal"] = True
    attention.args, attention.kwargs = tuple(args), kwargs


def _group_repeated_heads(attention: fx.Node) -> list[fx.Node]:
    """Pass `attention` the key and value heads a `repeat_kv` repeats, with `enable_gqa=True` (NOTE
    [grouped heads]); returns the repeats' nodes, unused now, or nothing where it changed nothing."""
    key_repeat = _repeat_kv(attention.args[KEY_ARGUMENT])
    value_repeat = _repeat_kv(attention.args[VALUE_ARGUMENT])
    if key_repeat is None or value_repeat is None or key_repeat.grouping != value_repeat.grouping:
        return []
    if key_repeat.size > GROUPED_HEAD_SIZE_LIMIT:
        return []
    args = list(attention.args)
    args[KEY_ARGUMENT], args[VALUE_ARGUMENT] = key_repeat.heads, value_repeat.heads
    attention.args, attention.kwargs = tuple(args), {**attention.kwargs, "enable_gqa": True}
    return [*key_repeat.nodes, *value_repeat.nodes]


@dataclass(frozen=True)
class Repeat:
    """A `repeat_kv` in a graph: the `heads` it repeats, `count` times each, of `size` elements, and
    its `nodes` (from the reshape back to the unsqueeze)."""

    heads: fx.Node
    count: int
    size: int
    nodes: tuple[fx.Node, ...]

    @property
    def grouping(self) -> tuple[int, int]:
        """How many query heads each head serves, and its size: key and value must agree on both."""
        return self.count, self.size


def _repeat_kv(node: Any) -> Repeat | None:
    """The heads that `node` repeats as `repeat_kv` does, each `count` times in a row: a [batch, heads,
    sequence, size] tensor unsqueezed at 2 (`[:, :, None, :, :]`, whose full slices a dynamic trace
    keeps), expanded there, and reshaped to [batch, heads x count, sequence, size]. None for anything
    else, or for a symbolic size."""
    if not isinstance(node, fx.Node) or node.target not in RESHAPES:
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not EXPAND:
        return None
    chain = [node, expand]
    unsqueeze = _through_full_slices(expand.args[0], chain)
    if unsqueeze is None or unsqueeze.target is not UNSQUEEZE or unsqueeze.args[1] != 2:
        return None
    chain.append(unsqueeze)
    heads = _through_full_slices(unsqueeze.args[0], chain)
    if heads is None:
        return None
    source, expanded, reshaped = _shape(heads), _shape(expand), _shape(node)
    if source is None or expanded is None or reshaped is None or len(source) != 4 or len(expanded) != 5:
        return None
    count = expanded[2]
    if not isinstance(count, int) or count < 2:
        return None
    batch, head_count, sequence, size = source
    if not isinstance(size, int) or not _same(expanded, (batch, head_count, count, sequence, size)):
        return None
    if not _same(reshaped, (batch, head_count * count, sequence, size)):
        return None
    return Repeat(heads, count, size, tuple(chain))


def _through_full_slices(node: Any, chain: list[fx.Node]) -> fx.Node | None:
    """The tensor `node` is, past slices that keep a whole dimension (added to `chain`)."""
    while isinstance(node, fx.Node) and node.target is SLICE and _is_full(node):
        chain.append(node)
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def _is_full(slice_node: fx.Node) -> bool:
    start, end, step = (list(slice_node.args[2:]) + [None, None, None])[:3]
    return (
        start in (None, 0)
        and (end is None or (isinstance(end, int) and end >= sys.maxsize))
        and (step in (None, 1))
    )


def _shape(node: fx.Node) -> tuple[Any, ...] | None:
    """The shape the trace recorded for `node`'s tensor, sizes symbolic or not."""
    value = node.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _same(shape: tuple[Any, ...], expected: tuple[Any, ...]) -> bool:
    """Whether two shapes, sizes symbolic or not, are provably equal."""
    return len(shape) == len(expected) and all(
        statically_known_true(size == want) for size, want in zip(shape, expected, strict=True)
    )


def _erase_unused(graph: fx.Graph, candidates: set[fx.Node]) -> None:
    """Erase the nodes of the dropped masks and repeats that nothing uses any more, last first."""
    for node in reversed(list(graph.nodes)):
        if node in candidates and not node.users:
            graph.erase_node(node)
