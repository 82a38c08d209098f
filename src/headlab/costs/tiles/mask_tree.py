"""The built-in mask patterns as the tile counters see them: a tree of nodes per (batch, head) slice.

:func:`structure` turns a mask into a tree: a composition is read from the mask's ``parts``
(``&``, ``|``, ``~`` of the masks it was built from), a leaf from its public ``name``
(``"sliding_window(256, causal)"``: the constructor and its arguments) and, where the name is
shortened or a tensor is involved, from its public attributes (``indices``, ``lengths``, ``layout``).
A mask it cannot read (a user function, BigBird's random blocks) raises
:class:`~headlab.costs.tiles.grid.Unsupported`, and the caller streams the block map instead.

The leaves live in :mod:`headlab.costs.tiles.offset_nodes` (offset patterns), :mod:`headlab.costs.tiles.run_nodes`
(global tokens, documents, padding, block layouts) and :mod:`headlab.costs.tiles.fixed_count`, the
combinations in :mod:`headlab.costs.tiles.logic_nodes`. Each node
answers, for one tile class of one run of block rows (:class:`~headlab.costs.tiles.grid.Row`), the
key tiles that are non-empty and those that are full, as interval lists, exactly as the pattern's
block classifier states them, and, for :mod:`headlab.costs.tiles.diagonal_count`, the state of one tile;
``&`` / ``|`` / ``~`` combine those states as block maps do (min, max, FULL <-> EMPTY), and
:class:`Combine` merges slices as the tiled kernel does, so the counts equal the block map's tile
for tile.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from headlab.costs.tiles.fixed_count import Fixed
from headlab.costs.tiles.grid import Unsupported
from headlab.costs.tiles.logic_nodes import CAUSAL, And, Combine, Not, Or
from headlab.costs.tiles.offset_nodes import Node, Offset
from headlab.costs.tiles.run_nodes import Documents, Global, KeyPrefix, Layout, runs_of

__all__ = ["CAUSAL", "And", "Combine", "Not", "Or", "slices", "structure"]

MAX_SLICES = 4096  # distinct (batch, head) slices of a mask read one by one, at most


# -- reading a mask's name ----------------------------------------------------------------------


def _split_top(text: str, seps: tuple[str, ...]):
    """Split ``text`` at a separator outside any brackets: ``(left, sep, right)`` or None."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif depth == 0:
            for sep in seps:
                if text.startswith(sep, i):
                    return text[:i], sep, text[i + len(sep) :]
    return None


def _ints(text: str) -> list[int]:
    if "..." in text:
        raise Unsupported("a shortened index list")
    return [int(x) for x in re.findall(r"-?\d+", text)]


_LEAF = re.compile(r"^(\w+)(?:\((.*)\))?$")


def _documents(lens) -> Documents:
    ends, total = [], 0
    for n in lens:
        total += int(n)
        ends.append(total)
    return Documents(tuple(ends))


def _leaf(name: str, args: str):
    a = [x.strip() for x in args.split(",")] if args and "[" not in args else []
    flags = {x for x in a if not re.fullmatch(r"-?\d+", x)}
    nums = [int(x) for x in a if re.fullmatch(r"-?\d+", x)]
    causal = "causal" in flags
    if name == "full" and not args:
        return Offset(((None, None),))
    if name == "causal" and not args:
        return CAUSAL
    if name == "causal_lower_right" and not args:
        return Offset(((0, None),), kv_minus_q=True)
    if name == "sliding_window" and len(nums) == 1:
        w = nums[0]
        return Offset(((0, w),) if causal else ((-w, w),))
    if name == "dilated_window" and len(nums) == 2:
        w, s = nums
        reach = w * s
        return Offset(((0, reach),) if causal else ((-reach, reach),), dilation=s)
    if name == "strided" and len(nums) == 1:
        s = nums[0]
        return Offset(((-s, s),) if "non-causal" in flags else ((0, s),), strided=s)
    if name == "fixed" and len(nums) == 2:
        return Fixed(nums[0], nums[1], causal="non-causal" not in flags)
    if name == "global_tokens" and args:
        return Global(runs_of(sorted(set(_ints(args)))))
    if name == "documents" and args:
        return _documents(_ints(args))
    if name == "bigbird":
        raise Unsupported("BigBird's random blocks are drawn per block row: only drawing them tells which tiles")
    raise Unsupported(f"no closed form for pattern {name!r}")


def _parse(text: str):
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        inner = text[1:-1]
        split = _split_top(inner, (" | ",)) or _split_top(inner, (" & ",))
        if split is not None:
            left, sep, right = split
            node = And if sep.strip() == "&" else Or
            return node(_parse(left), _parse(right))
        return _parse(inner)
    if text.startswith("~"):
        return Not(_parse(text[1:]))
    m = _LEAF.match(text)
    if m is None:
        raise Unsupported(f"cannot read mask {text!r}")
    return _leaf(m.group(1), m.group(2) or "")


# -- reading a mask object ----------------------------------------------------------------------


def _attr_leaf(mask, b: int, h: int):
    """The leaf of a built-in pattern read from its public attributes, or None."""
    name = str(mask.name)
    lay = getattr(mask, "layout", None)
    if lay is not None and getattr(mask, "cell", None) is not None:  # block_layout
        k = h if lay.shape[0] > 1 else 0
        return Layout(np.asarray(lay[k].cpu().numpy(), dtype=bool), tuple(mask.cell), key=(id(mask), k))
    lengths = getattr(mask, "lengths", None)
    if name.startswith("padding(") and lengths is not None:
        return KeyPrefix(int(lengths[b] if len(lengths) > 1 else lengths[0]))
    if name.startswith("documents(") and lengths is not None:
        return _documents(lengths)
    indices = getattr(mask, "indices", None)
    if name.startswith("global_tokens(") and indices is not None:
        return Global(runs_of(sorted({int(i) for i in indices})))
    return None


def structure(mask, b: int = 0, h: int = 0):
    """The tile-count tree of ``mask`` for batch element ``b`` and head ``h`` (None: no mask, every
    tile), or raise ``Unsupported``."""
    if mask is None:
        return Offset(((None, None),))
    parts = getattr(mask, "parts", ())
    if parts:
        if parts[0] == "~":
            return Not(structure(parts[1], b, h))
        left, right = structure(parts[1], b, h), structure(parts[2], b, h)
        return And(left, right) if parts[0] == "&" else Or(left, right)
    leaf = _attr_leaf(mask, b, h)
    if leaf is not None:
        return leaf
    if getattr(mask, "_blocks", None) is None:
        raise Unsupported(
            f"{mask.name!r} is not a built-in pattern: a function of your own is evaluated element by element"
        )
    if getattr(mask, "batch_dependent", False) or getattr(mask, "head_dependent", False):
        raise Unsupported(f"{mask.name!r} changes with the batch or head index in a way headlab cannot read")
    return _parse(str(mask.name))


def slices(mask, batch: int, heads: int) -> list[tuple[int, Node]]:
    """``(how many (batch, query head) pairs, tree)`` for each distinct slice of ``mask``'s block map."""
    if mask is None:
        return [(batch * heads, structure(None))]
    mask.check_sizes(batch, heads)  # a padding or per-head layout built for other sizes: the kernel's error
    bm = batch if mask.batch_dependent else 1
    hm = heads if mask.head_dependent else 1
    if bm * hm > MAX_SLICES:
        raise Unsupported(f"{bm * hm:,} (batch, head) slices of one mask")
    count = Counter(structure(mask, b, h) for b in range(bm) for h in range(hm))
    k = (batch // bm) * (heads // hm)
    return [(n * k, tree) for tree, n in count.items()]
