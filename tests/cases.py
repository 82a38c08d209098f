"""One named case table for every exact backend (core, tiled, sparse) and the statistics.

Shapes chosen to break tiling (113 x 203, head dim 59, q_len = 1), every mask kind, GQA,
float64 / half precisions and logit scales from 0.1 to 16 (large logits stress the backward
passes, which recompute P from the log-sum-exp). A backend that cannot serve a case is skipped
through its own ``supports(spec)`` with its reason (:func:`skip_unless_supported`), never silently.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from headlab import masks
from headlab.attention import backends
from headlab.spec.attention_spec import validate


@dataclass(frozen=True)
class Case:
    name: str
    batch: int = 2
    heads: int = 4
    kv_heads: int = 4
    q_len: int = 17
    kv_len: int = 17
    head_dim: int = 16
    v_dim: int | None = None
    dtype: torch.dtype = torch.float32
    causal: bool = False
    # None | "random" | "dead_rows" | "key_padding" | "fn" | "fn_lower_right" | "window" | "bigbird"
    # | "dilated" | "global" | "documents" | "layout_empty_rows" | "plain_fn" | "additive"
    # | "random_dead_row" | "dead_chunks" | "fn_dead_batch" | "fn_lower_right_padding"
    mask: str | None = None
    scale: float | None = None  # None: 1/sqrt(head_dim)
    noncontiguous: bool = False


CASES = [
    Case("odd_self"),
    Case("odd_cross", q_len=113, kv_len=203, head_dim=40),
    Case("longer_q", q_len=203, kv_len=113, head_dim=59, causal=True),
    Case("causal_square", q_len=65, kv_len=65, causal=True),
    Case("causal_rect", q_len=31, kv_len=47, causal=True),
    Case("gqa2", heads=8, kv_heads=4, q_len=33, kv_len=40),
    Case("gqa4_causal", heads=8, kv_heads=2, q_len=33, kv_len=33, causal=True),
    Case("gqa8_mqa", heads=8, kv_heads=1, q_len=29, kv_len=51),
    Case("v_dim_differs", head_dim=24, v_dim=40, q_len=20, kv_len=30),
    Case("random_mask", mask="random", q_len=37, kv_len=45),
    Case("fully_masked_rows", mask="dead_rows", q_len=23, kv_len=31),
    Case("key_padding", mask="key_padding", q_len=19, kv_len=19),
    Case("mask_fn", mask="fn", q_len=40, kv_len=40),
    Case("mask_fn_lower_right", mask="fn_lower_right", q_len=12, kv_len=30, heads=4, kv_heads=2),
    Case("plain_fn_causal", mask="plain_fn", q_len=45, kv_len=45, causal=True),
    Case("noncontiguous", noncontiguous=True, q_len=21, kv_len=26, heads=4, kv_heads=2),
    Case("window_113x203_gqa", batch=1, heads=4, kv_heads=2, q_len=113, kv_len=203, head_dim=40, v_dim=24,
         mask="window"),
    Case("window_causal_300", batch=1, heads=2, kv_heads=1, q_len=300, kv_len=300, head_dim=32, mask="window",
         causal=True),
    Case("dilated", q_len=300, kv_len=300, heads=2, kv_heads=2, mask="dilated"),
    Case("window_or_global", batch=1, heads=2, kv_heads=2, q_len=257, kv_len=257, mask="global"),
    Case("bigbird_gqa", batch=1, heads=6, kv_heads=2, q_len=400, kv_len=400, mask="bigbird"),
    Case("layout_empty_rows", batch=1, heads=2, kv_heads=2, q_len=128, kv_len=128, mask="layout_empty_rows"),
    Case("documents_causal", batch=1, heads=2, kv_heads=2, q_len=350, kv_len=350, mask="documents", causal=True),
    Case("additive_float_mask", mask="additive", q_len=33, kv_len=41),
    # logits from soft to sharp: the backward passes recompute P from the log-sum-exp
    Case("scale_0.1", q_len=64, kv_len=64, scale=0.1, causal=True),
    Case("scale_2", batch=1, heads=3, kv_heads=3, q_len=64, kv_len=64, head_dim=32, scale=2.0, causal=True),
    Case("scale_8", batch=1, heads=3, kv_heads=3, q_len=64, kv_len=64, head_dim=32, scale=8.0, causal=True),
    Case("scale_16", batch=1, heads=3, kv_heads=3, q_len=64, kv_len=64, head_dim=32, scale=16.0),
    Case("scale_16_window", batch=1, heads=2, kv_heads=2, q_len=300, kv_len=300, head_dim=32, scale=16.0, mask="window"),
    Case("few_keys_many_rows", batch=1, heads=2, kv_heads=2, q_len=300, kv_len=3, head_dim=16, scale=4.0),
    Case("two_keys_causal_lr", batch=1, heads=2, kv_heads=2, q_len=200, kv_len=2, scale=8.0, mask="fn_lower_right"),
    Case("lq1_bigbird", batch=2, heads=8, kv_heads=2, q_len=1, kv_len=491, head_dim=32, scale=2.0,
         mask="bigbird_lr"),
    Case("lq1_decode", batch=4, heads=8, kv_heads=8, q_len=1, kv_len=203, head_dim=59, scale=2.0),
    Case("causal_1023x1024", batch=1, heads=1, kv_heads=1, q_len=1023, kv_len=1024, head_dim=64, causal=True),
    Case("dense_1023x1024", batch=1, heads=1, kv_heads=1, q_len=1023, kv_len=1024, head_dim=64),
    Case("d111_512x256", batch=1, heads=2, kv_heads=2, q_len=512, kv_len=256, head_dim=111),
    # the statistics' cases (tests/test_stats.py adds tile sizes and caches to these)
    Case("plain_37x53", q_len=37, kv_len=53),
    Case("causal_odd_gqa", batch=1, heads=4, kv_heads=2, q_len=113, kv_len=203, head_dim=32, causal=True),
    Case("random_dead_row_113x203", q_len=113, kv_len=203, mask="random_dead_row"),
    Case("key_padding_gqa3", heads=6, kv_heads=2, q_len=37, kv_len=53, mask="key_padding"),
    Case("dead_chunks_causal", q_len=70, kv_len=70, mask="dead_chunks", causal=True),
    Case("dead_chunks_gqa", heads=6, kv_heads=3, q_len=70, kv_len=70, mask="dead_chunks", causal=True),
    Case("fn_dead_batch", q_len=60, kv_len=60, mask="fn_dead_batch"),
    Case("fn_lower_right_padding", heads=8, kv_heads=2, q_len=20, kv_len=90, mask="fn_lower_right_padding"),
    Case("float64", dtype=torch.float64, q_len=50, kv_len=60, causal=True),
    Case("float64_random_mqa", dtype=torch.float64, heads=4, kv_heads=1, q_len=113, kv_len=203,
         mask="random_dead_row"),
    Case("float64_fn_dead_batch", dtype=torch.float64, q_len=60, kv_len=60, mask="fn_dead_batch"),
    Case("float64_window", dtype=torch.float64, batch=1, heads=2, kv_heads=2, q_len=150, kv_len=150, mask="window"),
    Case("bfloat16", dtype=torch.bfloat16, q_len=64, kv_len=80),
    Case("bfloat16_masked", dtype=torch.bfloat16, q_len=33, kv_len=33, mask="dead_rows"),
    Case("float16", dtype=torch.float16, q_len=48, kv_len=48, causal=True),
    Case("float16_gqa6", dtype=torch.float16, batch=1, heads=6, kv_heads=1, q_len=64, kv_len=64, head_dim=32),
]

BY_NAME = {c.name: c for c in CASES}


def _layout_empty_rows():
    lay = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(3)) > 0.5
    lay[0, 1] = False  # head 0: query block 1 sees nothing
    lay[1, :, 0] = True
    return masks.block_layout(lay, 32)


def make_mask(c: Case, g: torch.Generator):
    B, H, Lq, Lk = c.batch, c.heads, c.q_len, c.kv_len
    if c.mask is None:
        return None
    if c.mask == "random":
        return torch.rand(B, 1, Lq, Lk, generator=g) > 0.4
    if c.mask == "dead_rows":
        m = torch.rand(B, H, Lq, Lk, generator=g) > 0.5
        m[:, :, 3] = False  # query 3 sees nothing in every head
        m[0, min(1, H - 1), 7] = False
        return m
    if c.mask == "random_dead_row":
        m = torch.rand(B, 1, Lq, Lk, generator=g) > 0.4
        m[:, :, 3] = False  # a fully masked row
        return m
    if c.mask == "dead_chunks":
        m = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
        m[:, :, 10:30] = False  # whole query chunks that see nothing
        m[-1, :, 40:, :5] = False  # with causal: rows 40.. see keys 5..i only
        m[-1, :, 41] = False
        return m
    if c.mask == "fn_dead_batch":
        return masks.causal() & masks.padding([Lk - 9, 0][:B])  # batch 1 sees nothing at all
    if c.mask == "fn_lower_right_padding":
        return masks.causal_lower_right() & masks.padding([Lk, Lk - 30][:B])
    if c.mask == "key_padding":
        lengths = torch.tensor([Lk, Lk - 5])[:B]
        return (torch.arange(Lk)[None, :] < lengths[:, None]).view(B, 1, 1, Lk)
    if c.mask == "fn":
        return masks.causal() & masks.padding([Lk - 3, Lk - 11][:B])
    if c.mask == "fn_lower_right":
        return masks.causal_lower_right()
    if c.mask == "plain_fn":
        def band(b, h, q, kv):  # a plain function: each head its own window (no block hint)
            return (q - kv).abs() <= (h + 2 + 3 * b)
        return band
    if c.mask == "window":
        return masks.sliding_window(37)
    if c.mask == "dilated":
        return masks.dilated_window(20, 3)
    if c.mask == "global":
        return masks.sliding_window(16) | masks.global_tokens([0, 200])
    if c.mask == "bigbird":
        return masks.bigbird(32, 3, 1, 2, seed=1)
    if c.mask == "bigbird_lr":  # one decoding query against a bigbird cache
        return masks.bigbird(16, 3, 1, 2, seed=2) & masks.causal_lower_right()
    if c.mask == "layout_empty_rows":
        return _layout_empty_rows()
    if c.mask == "documents":
        return masks.documents([100, 7, 150, 93])
    if c.mask == "additive":  # torch SDPA's float masks: a bias, -inf where hidden
        bias = torch.randn(B, 1, Lq, Lk, generator=g)
        bias[torch.rand(B, 1, Lq, Lk, generator=g) > 0.7] = float("-inf")
        bias[:, :, 2] = float("-inf")  # a row that sees no key
        return bias
    raise AssertionError(c.mask)


def make_inputs(c: Case):
    """``q, k, v, mask`` of a case, the same on every call."""
    g = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))
    vd = c.v_dim or c.head_dim
    if c.noncontiguous:  # (B, T, H, D) storage viewed as (B, H, T, D)
        q = torch.randn(c.batch, c.q_len, c.heads, c.head_dim, generator=g).transpose(1, 2)
        k = torch.randn(c.batch, c.kv_len, c.kv_heads, c.head_dim, generator=g).transpose(1, 2)
        v = torch.randn(c.batch, c.kv_len, c.kv_heads, vd, generator=g).transpose(1, 2)
    else:
        q = torch.randn(c.batch, c.heads, c.q_len, c.head_dim, generator=g)
        k = torch.randn(c.batch, c.kv_heads, c.kv_len, c.head_dim, generator=g)
        v = torch.randn(c.batch, c.kv_heads, c.kv_len, vd, generator=g)
    mask = make_mask(c, g)
    q, k, v = (t.to(c.dtype) for t in (q, k, v))
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        mask = mask.to(c.dtype)
    return q, k, v, mask


def supported(backend: str, c: Case, q, k, v, mask, *, grads: bool = True) -> tuple[bool, str]:
    """``backend.supports(spec)`` for this case (with gradients when ``grads``)."""
    qq = q.detach().requires_grad_(grads and not q.dtype == torch.int64)
    spec, _ = validate(qq, k, v, mask=mask, causal=c.causal)
    return backends.get(backend).supports(spec)


def skip_unless_supported(backend: str, c: Case, q, k, v, mask, *, grads: bool = True) -> None:
    ok, why = supported(backend, c, q, k, v, mask, grads=grads)
    if not ok:
        pytest.skip(f"{backend} cannot serve {c.name}: {why}")


def random_composition(rng, depth: int, leaves, p_leaf: float) -> str:
    """A random mask spec: a leaf from ``leaves(rng)`` (drawn afresh at every node), or with probability
    ``1 - p_leaf`` (while ``depth`` lasts) ``~(x)``, ``(x)&(y)`` or ``(x)|(y)`` of random compositions."""
    options = leaves(rng)
    if depth == 0 or rng.random() < p_leaf:
        return rng.choice(options)
    op = rng.choice("&|~")
    if op == "~":
        return f"~({random_composition(rng, depth - 1, leaves, p_leaf)})"
    return f"({random_composition(rng, depth - 1, leaves, p_leaf)}){op}({random_composition(rng, depth - 1, leaves, p_leaf)})"


def random_geometry(rng, max_tile: int, max_len: int = 90) -> tuple[int, int, int, int, bool]:
    """``(q_len, kv_len, block_q, block_k, causal)`` for a fuzz case: lengths up to ``max_len`` (equal half
    the time), tiles up to ``max_tile``, causal half the time."""
    lq, lk = rng.randint(1, max_len), rng.randint(1, max_len)
    lk = lq if rng.random() < 0.5 else lk
    bq, bk = rng.randint(1, max_tile), rng.randint(1, max_tile)
    return lq, lk, bq, bk, rng.random() < 0.5


def visited_entries(states, lq: int, lk: int, bq: int, bk: int, causal: bool) -> int:
    """Score entries inside the tiles a tiled kernel visits: ``states (n_qb, n_kb)`` non-zero where it
    visits; under ``causal`` a key tile stops at its query block's end, element by element."""
    nq, nk = states.shape
    rows = torch.full((nq,), bq)
    rows[-1] = lq - bq * (nq - 1)
    cols = torch.full((nk,), bk)
    cols[-1] = lk - bk * (nk - 1)
    width = cols[None, :].expand(nq, nk)
    if causal:
        start = torch.arange(nk) * bk
        width = (torch.minimum(start[None, :] + cols[None, :], torch.cumsum(rows, 0)[:, None]) - start[None, :]).clamp(min=0)
    return int((rows[:, None] * width * (states != 0)).sum())
