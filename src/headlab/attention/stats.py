"""Per-head attention statistics without the n x n map: :func:`attention_stats`.

Looking inside attention usually means materialising every ``(batch, heads, q_len, kv_len)``
map (32 GiB for the seed's 32 layers x 32 heads at 4,096 tokens in float16). The numbers an
analyst reads off those maps are much smaller: one value per query, or per key, or a handful of
rows. :func:`attention_stats` computes them in passes over key tiles whose memory grows linearly
with the sequence length, and returns an :class:`AttentionStats`.

Statistics (``P`` is the attention map, ``i`` a query position, ``j`` a key position)::

    name            shape                          definition
    lse             (B, H, Lq)                     log sum_j exp(S_ij)        (S = q k^T * scale + mask)
    entropy         (B, H, Lq)                     -sum_j P_ij log P_ij       (natural log)
    max_weight      (B, H, Lq)                     max_j P_ij
    argmax          (B, H, Lq)  int64              the key j with the largest P_ij (the first on ties)
    mean_distance   (B, H, Lq)                     sum_j P_ij |i - j|
    key_mass        (B, H, Lq, len(key_positions)) P_ij at the chosen keys j = key_positions[m]
    received        (B, H, Lk)                     sum_i P_ij  (column sums: mass each key receives)
    rows            (B, H, len(query_rows), Lk)    exact rows P_i. for the chosen queries
    output          (B, H, Lq, Dv)                 P v, only when ``v`` is given

A query row that can see no key at all (fully masked) has ``lse = -inf``, ``entropy = 0``,
``max_weight = 0``, ``argmax = -1``, ``mean_distance = 0``, ``key_mass = 0``, a zero ``rows`` entry
and a zero output row, and adds nothing to ``received``; no statistic is ever NaN.

Two ways of computing them (``method``):

* ``"tiled"`` (default): query chunks of ``block_q`` rows; pass 1 walks the key tiles with the
  online softmax (REFERENCES.md section 2) for ``lse``, ``max_weight`` and ``argmax``; pass 2 turns
  each score tile into probabilities ``P = exp(S - lse)`` and accumulates entropy, distance, column
  sums and the output. Score tiles of one query chunk are kept between the passes when they fit
  ``cache_bytes`` (default 64 MiB), otherwise recomputed. Tiles a mask leaves empty are skipped
  (causal, boolean masks, and mask functions through their
  :class:`~headlab.attention.blocks.BlockMap`). Supports every statistic.
* ``"sdpa"``: torch's fused CPU flash kernel delivers what an identity allows (REFERENCES.md
  section 3): ``lse`` from the kernel itself, ``entropy = lse - scale * q . (P K)`` with
  ``P K`` = attention with ``V := K``, ``mean_distance`` from attention with ``V := positions``
  (plus a second, causal call for the keys left of each query when the call is not causal),
  ``received`` = gradient of ``sum(out)`` with respect to ``V``, from the kernel's fused backward.
  ``max_weight`` and ``argmax`` have no such identity and raise
  :class:`~headlab.errors.BackendUnsupportedError`; ``stats=None`` then means every statistic
  the method supports. Masks (boolean or functions) are handed to the kernel as an additive
  float mask, which holds ``Lq x Lk`` values per (batch, head) the mask depends on: use
  ``"tiled"`` when the mask is large. ``causal=True`` alone needs no mask.

``key_mass`` and ``rows`` are computed the same way by both methods, from the final ``lse`` and
the scores of the chosen keys / queries only (``O(Lq * len(key_positions))`` and
``O(len(query_rows) * Lk)`` work).

Every statistic is computed in float32 at least (float16 / bfloat16 inputs are upcast) and
float64 inputs stay float64.

Example::

    >>> import torch, headlab
    >>> from headlab import masks
    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(2, 4, 10, 8, generator=g); k = torch.randn(2, 2, 10, 8, generator=g)  # GQA
    >>> st = headlab.attention_stats(q, k, mask=masks.causal() & masks.padding([10, 7]),
    ...                              key_positions=[0], query_rows=[9])
    >>> st.entropy.shape, st.received.shape, st.key_mass.shape, st.rows.shape
    (torch.Size([2, 4, 10]), torch.Size([2, 4, 10]), torch.Size([2, 4, 10, 1]), torch.Size([2, 4, 1, 10]))
    >>> w = headlab.attention_weights(q, k, mask=masks.causal() & masks.padding([10, 7]))
    >>> torch.allclose(st.received, w.sum(-2), atol=1e-5), torch.allclose(st.rows, w[:, :, [9]], atol=1e-6)
    (True, True)
    >>> st.entropy[:, :, 0]          # the first query sees one key: entropy 0
    tensor([[0., 0., 0., 0.],
            [0., 0., 0., 0.]])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch

from headlab.attention.blocks import EMPTY, FULL
from headlab.attention.masks import MaskFn
from headlab.attention.spec import AttentionSpec, default_scale, validate
from headlab.errors import BackendUnsupportedError, ConfigError, DTypeError, ShapeError

__all__ = ["STATS", "SDPA_STATS", "AttentionStats", "attention_stats"]

Method = Literal["tiled", "sdpa"]

# Every statistic, in the order AttentionStats lists them.
STATS = ("lse", "entropy", "max_weight", "argmax", "mean_distance", "key_mass", "received", "rows")
# What method="sdpa" can deliver through the fused kernel (plus key_mass / rows, computed directly).
SDPA_STATS = ("lse", "entropy", "mean_distance", "key_mass", "received", "rows")

# Score tiles of one query chunk kept between pass 1 and pass 2 when they fit this many bytes.
DEFAULT_CACHE_BYTES = 64 << 20
# The automatic query chunk keeps one (B, H, block_q, block_k) tile near this many bytes.
_TILE_BYTES = 16 << 20


@dataclass(frozen=True)
class AttentionStats:
    """Statistics of one attention call. Fields not asked for are ``None``.

    Shapes (B batch, H query heads, Lq queries, Lk keys); floating fields have the compute dtype
    (float32, or float64 for float64 inputs):

    * ``lse``, ``entropy``, ``max_weight``, ``mean_distance``: ``(B, H, Lq)``; ``argmax``:
      ``(B, H, Lq)`` int64 key index (``-1`` for a fully masked row),
    * ``key_mass``: ``(B, H, Lq, M)``, M = number of ``key_positions``,
    * ``received``: ``(B, H, Lk)``,
    * ``rows``: ``(B, H, R, Lk)``, R = number of ``query_rows``,
    * ``output``: ``(B, H, Lq, Dv)`` attention output (only when ``v`` was given),
    * ``key_positions``: the positions used, ``(M,)`` or ``(B, M)`` int64; ``query_rows``: ``(R,)``,
    * ``visible``: ``(B, H, Lq)`` bool, False for fully masked query rows,
    * ``method``: ``"tiled"`` or ``"sdpa"``.
    """

    lse: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    max_weight: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    mean_distance: torch.Tensor | None = None
    key_mass: torch.Tensor | None = None
    received: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    output: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    query_rows: torch.Tensor | None = None
    visible: torch.Tensor | None = None
    method: str = "tiled"

    def computed(self) -> list[str]:
        """Names of the statistics present (a subset of :data:`STATS`)."""
        return [name for name in STATS if getattr(self, name) is not None]

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The tensors present, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def nbytes(self) -> int:
        """Bytes held by the tensors (what keeping these statistics costs)."""
        return sum(t.numel() * t.element_size() for t in self.as_dict().values())

    def head_means(self) -> dict[str, torch.Tensor]:
        """Per-head means ``(B, H)`` of the per-query statistics over the visible query rows."""
        vis = self.visible.to(self.lse.dtype if self.lse is not None else torch.float32)
        count = vis.sum(-1).clamp_min(1)
        out = {}
        for name in ("lse", "entropy", "max_weight", "mean_distance"):
            t = getattr(self, name)
            if t is not None:
                out[name] = torch.where(self.visible, t, torch.zeros((), dtype=t.dtype)).sum(-1) / count
        return out


# -- argument checks ----------------------------------------------------------------------------

def _wanted(stats, method: str, key_positions, query_rows) -> set[str]:
    supported = STATS if method == "tiled" else SDPA_STATS
    if stats is None:
        want = set(supported)
        if key_positions is None:
            want.discard("key_mass")
        if query_rows is None:
            want.discard("rows")
        return want
    if isinstance(stats, str):
        stats = [stats]
    want = set()
    for name in stats:
        if name not in STATS:
            raise ConfigError(f"unknown statistic {name!r}; choose among {', '.join(STATS)}")
        if name not in supported:
            raise BackendUnsupportedError(
                f"method={method!r} cannot compute {name!r} (no identity lets the fused kernel deliver it); "
                f"it supports {', '.join(supported)}; use method='tiled' for {name!r}"
            )
        want.add(name)
    if "key_mass" in want and key_positions is None:
        raise ConfigError("statistic 'key_mass' needs key_positions, e.g. key_positions=[0] for the first token")
    if "rows" in want and query_rows is None:
        raise ConfigError("statistic 'rows' needs query_rows, e.g. query_rows=[0, 5] for queries 0 and 5")
    return want


def _index_tensor(name: str, value, length: int, batch: int, *, per_batch_ok: bool) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value
    else:
        try:
            t = torch.as_tensor(list(value) if isinstance(value, Iterable) else [value])
        except (TypeError, ValueError, RuntimeError):
            raise ConfigError(f"{name} must be integer positions, got {value!r}") from None
    if t.numel() == 0:
        raise ConfigError(f"{name} is empty; give at least one position")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise DTypeError(f"{name} must hold integer positions, got dtype {t.dtype}")
    t = t.to(torch.long)
    allowed = "(n,) or (batch, n)" if per_batch_ok else "(n,)"
    if t.dim() == 2 and per_batch_ok:
        if t.shape[0] != batch:
            raise ShapeError(f"{name} given per batch element must have shape (batch={batch}, n), got {tuple(t.shape)}")
    elif t.dim() != 1:
        raise ShapeError(f"{name} must have shape {allowed}, got {tuple(t.shape)}")
    if bool(((t < 0) | (t >= length)).any()):
        raise ConfigError(f"{name} must lie in [0, {length}), got {t.tolist()}")
    return t


# -- visibility ------------------------------------------------------------------------------------

class _Visibility:
    """Answers, for a query range and a key range, whether the tile is empty, full or partial and,
    when partial, the boolean visibility (broadcastable to (B, H, rows, cols))."""

    def __init__(self, spec: AttentionSpec, mask, block_q: int, block_k: int) -> None:
        self.spec = spec
        self.causal = spec.causal
        self.mask = mask
        self.block_q, self.block_k = block_q, block_k
        self.states = None
        if isinstance(mask, torch.Tensor):
            self.mask = mask.expand(mask.shape[0], mask.shape[1], spec.q_len, spec.kv_len)  # (Bm, Hm, Lq, Lk)
        elif isinstance(mask, MaskFn):
            bm = mask.block_map(spec.q_len, spec.kv_len, block_q, block_k, batch=spec.batch, heads=spec.heads,
                                device=spec.device)
            st = bm.state  # (Bm, Hm, n_qb, n_kb)
            self.states = (st == EMPTY).flatten(0, 1).all(0), (st == FULL).flatten(0, 1).all(0)  # (n_qb, n_kb)

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> tuple[bool, torch.Tensor | None]:
        """(skip, visibility or None when every entry is visible)."""
        dev = self.spec.device
        vis = None
        if self.causal:
            if c0 > r1 - 1:
                return True, None
            if c1 - 1 > r0:
                vis = (torch.arange(r0, r1, device=dev)[:, None] >= torch.arange(c0, c1, device=dev)[None, :])
        if isinstance(self.mask, torch.Tensor):
            sub = self.mask[:, :, r0:r1, c0:c1]  # (Bm, Hm, rows, cols)
            if not bool(sub.any()):
                return True, None
            if not bool(sub.all()):
                vis = sub if vis is None else (sub & vis)
        elif isinstance(self.mask, MaskFn):
            empty, full = self.states
            qb, kb = r0 // self.block_q, c0 // self.block_k
            if bool(empty[qb, kb]):
                return True, None
            if not bool(full[qb, kb]):
                sub = _eval_mask(self.mask, self.spec, torch.arange(r0, r1, device=dev),
                                 torch.arange(c0, c1, device=dev))
                vis = sub if vis is None else (sub & vis)
        if vis is not None and vis.dim() == 2:
            vis = vis.view(1, 1, *vis.shape)
        return False, vis


def _eval_mask(mask: MaskFn, spec: AttentionSpec, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """The mask function at the given query and key positions: (Bm, Hm, len(q_idx), len(kv_idx)) bool,
    or (B, Hm, len(q_idx), M) when ``kv_idx`` is a (B, M) tensor of per-batch positions."""
    bm = spec.batch if (mask.batch_dependent or kv_idx.dim() == 2) else 1
    hm = spec.heads if mask.head_dependent else 1
    b = torch.arange(bm, device=spec.device).view(bm, 1, 1, 1)
    h = torch.arange(hm, device=spec.device).view(1, hm, 1, 1)
    q = q_idx.view(1, 1, -1, 1)
    kv = kv_idx.view(bm, 1, 1, -1) if kv_idx.dim() == 2 else kv_idx.view(1, 1, 1, -1)
    out = mask.evaluate(b, h, q, kv, spec.q_len, spec.kv_len)
    return torch.broadcast_to(out, (bm, hm, q.shape[2], kv.shape[-1]))


def _visible_at(spec: AttentionSpec, mask, q_idx: torch.Tensor | None, kv_idx: torch.Tensor | None):
    """Visibility of the (query, key) pairs q_idx x kv_idx (None = all), broadcastable to
    (B, H, R, M); ``kv_idx`` is ``(M,)`` or per batch ``(B, M)``. None when everything is visible."""
    dev = spec.device
    qi = torch.arange(spec.q_len, device=dev) if q_idx is None else q_idx
    ki = torch.arange(spec.kv_len, device=dev) if kv_idx is None else kv_idx
    kv4 = ki.view(ki.shape[0], 1, 1, -1) if ki.dim() == 2 else ki.view(1, 1, 1, -1)
    vis = None
    if spec.causal:
        vis = qi.view(1, 1, -1, 1) >= kv4
    if isinstance(mask, torch.Tensor):
        m = mask.expand(mask.shape[0], mask.shape[1], spec.q_len, spec.kv_len)  # (Bm, Hm, Lq, Lk) view
        if kv_idx is not None and kv_idx.dim() == 2:  # per-batch keys: gather (B, Hm, Lq, M)
            m = m.expand(spec.batch, -1, -1, -1)
            m = torch.gather(m, 3, kv4.expand(spec.batch, m.shape[1], m.shape[2], -1))
        elif kv_idx is not None:
            m = m[..., kv_idx]  # (Bm, Hm, Lq, M)
        sub = m if q_idx is None else m[:, :, q_idx]  # (Bm, Hm, R, M)
        vis = sub if vis is None else (sub & vis)
    elif isinstance(mask, MaskFn):
        sub = _eval_mask(mask, spec, qi, ki)
        vis = sub if vis is None else (sub & vis)
    return vis


# -- the exact entries both methods share ------------------------------------------------------------

def _scores_at(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec, scale: float, ct: torch.dtype,
               q_idx: torch.Tensor | None, kv_idx: torch.Tensor | None) -> torch.Tensor:
    """Scores ``q_i . k_j * scale`` for chosen queries and/or keys: (B, H, R, M) in ``ct``."""
    B, H, Hkv, G = spec.batch, spec.heads, spec.kv_heads, spec.group
    qs = q if q_idx is None else q[:, :, q_idx]  # (B, H, R, D)
    R = qs.shape[2]
    if kv_idx is None:
        ks = k  # (B, Hkv, Lk, D)
    elif kv_idx.dim() == 2:  # per batch (B, M)
        ks = torch.gather(k, 2, kv_idx.view(B, 1, -1, 1).expand(B, Hkv, kv_idx.shape[1], k.shape[-1]))
    else:
        ks = k[:, :, kv_idx]  # (B, Hkv, M, D)
    qg = qs.to(ct).reshape(B, Hkv, G * R, -1)  # (B, Hkv, G*R, D): heads sharing a kv head stacked
    s = torch.matmul(qg, ks.to(ct).transpose(-1, -2))  # (B, Hkv, G*R, M)
    return s.view(B, H, R, -1).mul_(scale)  # (B, H, R, M)


def _probs_at(q, k, spec, mask, scale, ct, lse, q_idx, kv_idx) -> torch.Tensor:
    """Exact ``P_ij`` for the chosen queries / keys from the final ``lse``: (B, H, R, M)."""
    s = _scores_at(q, k, spec, scale, ct, q_idx, kv_idx)
    vis = _visible_at(spec, mask, q_idx, kv_idx)
    l_sel = lse if q_idx is None else lse[:, :, q_idx]  # (B, H, R)
    dead = torch.isneginf(l_sel).unsqueeze(-1)
    p = torch.exp(s - torch.where(dead, 0.0, l_sel.unsqueeze(-1)))
    if vis is not None:
        p = p.masked_fill(~vis, 0.0)
    return p.masked_fill(dead, 0.0)


# -- method "tiled" ----------------------------------------------------------------------------------

def _auto_block_q(spec: AttentionSpec, block_k: int, cache_bytes: int, itemsize: int) -> int:
    """Query rows per chunk: a power of two that keeps one (B, H, block_q, block_k) tile near 16 MiB
    and, when possible, the chunk's whole row of score tiles within ``cache_bytes``."""
    per_row = spec.batch * spec.heads * min(block_k, spec.kv_len) * itemsize
    bq = max(16, _TILE_BYTES // max(1, per_row))
    slab_rows = cache_bytes // max(1, spec.batch * spec.heads * spec.kv_len * itemsize)
    if slab_rows >= 16:
        bq = min(bq, slab_rows)
    bq = 1 << (bq.bit_length() - 1)
    return min(bq, 1024, max(16, 1 << (spec.q_len - 1).bit_length()))


# A finite stand-in for -inf in cached score tiles: exp(NEG - m) is exactly 0 and 0 * (NEG - m)
# is 0, not NaN, so masked entries drop out of every sum without a clamp.
_NEG = -1e30


def _tiled(q, k, v, spec: AttentionSpec, mask, scale: float, want: set[str], ct: torch.dtype,
           block_q: int, block_k: int, cache_bytes: int):
    B, H, Lq, D = q.shape
    Hkv, G, Lk = spec.kv_heads, spec.group, spec.kv_len
    dev = q.device
    itemsize = torch.empty((), dtype=ct).element_size()
    vis_of = _Visibility(spec, mask, block_q, block_k)
    need_p2 = bool(want & {"entropy", "mean_distance", "received"}) or v is not None

    acc = {
        "lse": torch.empty(B, H, Lq, dtype=ct, device=dev),
        "entropy": torch.zeros(B, H, Lq, dtype=ct, device=dev) if "entropy" in want else None,
        "mean_distance": torch.zeros(B, H, Lq, dtype=ct, device=dev) if "mean_distance" in want else None,
        "received": torch.zeros(B, H, Lk, dtype=ct, device=dev) if "received" in want else None,
        "max_weight": torch.empty(B, H, Lq, dtype=ct, device=dev) if "max_weight" in want else None,
        "argmax": torch.empty(B, H, Lq, dtype=torch.long, device=dev) if "argmax" in want else None,
        "output": torch.zeros(B, H, Lq, v.shape[-1], dtype=ct, device=dev) if v is not None else None,
    }
    kpos = torch.arange(Lk, device=dev, dtype=ct)

    for r0 in range(0, Lq, block_q):
        r1 = min(Lq, r0 + block_q)
        n = r1 - r0
        qc = q[:, :, r0:r1].to(ct).mul(scale).view(B, Hkv, G * n, D)  # (B, Hkv, G*n, D), pre-scaled
        tiles = []
        for c0 in range(0, Lk, block_k):
            c1 = min(Lk, c0 + block_k)
            skip, vis = vis_of.tile(r0, r1, c0, c1)
            if not skip:
                tiles.append((c0, c1, vis))

        def scores(c0, c1, vis, fill=float("-inf")):
            kt = k[:, :, c0:c1].to(ct)  # (B, Hkv, w, D)
            s = torch.matmul(qc, kt.transpose(-1, -2)).view(B, H, n, c1 - c0)  # (B, H, n, w)
            if vis is not None:
                s.masked_fill_(~vis, fill)
            return s

        slab = B * H * n * sum(c1 - c0 for c0, c1, _ in tiles) * itemsize
        chunk = _chunk_cached if (need_p2 and slab <= cache_bytes) else _chunk_streamed
        chunk(acc, tiles, scores, r0, r1, v, kpos, ct)
    return acc


def _distance_tile(p: torch.Tensor, r0: int, r1: int, c0: int, c1: int, kpos: torch.Tensor,
                   rowsum: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j p_ij |i - j| over one tile: (B, H, n). Tiles wholly left or right of the chunk's
    queries need only sum_j p_ij j and sum_j p_ij (matrix-vector products)."""
    B, H, n, w = p.shape
    qi = torch.arange(r0, r1, device=p.device, dtype=p.dtype)
    if c1 - 1 <= r0 or c0 >= r1 - 1:
        p2 = p.view(B * H * n, w)  # (B*H*n, w)
        pj = torch.mv(p2, kpos[c0:c1]).view(B, H, n)
        ps = torch.mv(p2, torch.ones_like(kpos[c0:c1])).view(B, H, n) if rowsum is None else rowsum
        return qi * ps - pj if c1 - 1 <= r0 else pj - qi * ps
    return (p * (qi.view(n, 1) - kpos[c0:c1]).abs_()).sum(-1)


def _chunk_cached(acc, tiles, scores, r0, r1, v, kpos, ct):
    """One query chunk whose score tiles all fit in memory: one matmul and one exp per score.

    With m the row max, t = S - m, e = exp(t) and l = sum_j e_ij:
    lse = m + log l, max weight = 1 / l, entropy = log l - sum_j e_ij t_ij / l,
    mean distance = sum_j e_ij |i - j| / l, received_j = sum_i e_ij / l_i, output = (e V) / l.
    """
    cached = []
    m = None
    a = None
    for c0, c1, vis in tiles:
        s = scores(c0, c1, vis, _NEG)
        cached.append(s)
        if acc["argmax"] is not None:
            tmax, targ = s.max(dim=-1)  # (B, H, n)
            a = targ + c0 if a is None else torch.where(tmax > m, targ + c0, a)
        else:
            tmax = s.amax(dim=-1)
        m = tmax if m is None else torch.maximum(m, tmax)
    if not tiles:  # nothing visible for the whole chunk
        _write_dead(acc, r0, r1)
        return
    B, H, n = m.shape
    dead = m < _NEG / 2  # (B, H, n): rows that see no key
    m = m.masked_fill(dead, 0.0)
    l = torch.zeros_like(m)
    u = torch.zeros_like(m) if acc["entropy"] is not None else None
    dsum = torch.zeros_like(m) if acc["mean_distance"] is not None else None
    out = None
    for idx, (c0, c1, _vis) in enumerate(tiles):
        t = cached[idx].sub_(m.unsqueeze(-1))  # (B, H, n, w): S - m, <= 0
        e = torch.exp(t)
        e2 = e.view(B * H * n, c1 - c0)
        ls = torch.mv(e2, torch.ones(c1 - c0, dtype=ct, device=e.device)).view(B, H, n)
        l += ls
        if u is not None:  # row-wise dot products sum_j e_ij t_ij as a batch of (1 x w) @ (w x 1)
            u += torch.bmm(e.view(B * H * n, 1, c1 - c0), t.view(B * H * n, c1 - c0, 1)).view(B, H, n)
        del t
        if dsum is not None:
            dsum += _distance_tile(e, r0, r1, c0, c1, kpos, ls)
        if v is not None:
            Hkv = v.shape[1]
            vt = v[:, :, c0:c1].to(ct)  # (B, Hkv, w, Dv)
            pv = torch.matmul(e.view(B, Hkv, -1, c1 - c0), vt).view(B, H, n, -1)  # (B, H, n, Dv)
            out = pv if out is None else out.add_(pv)
        cached[idx] = e
    l = l.masked_fill(dead, 1.0)
    inv_l = (1.0 / l).masked_fill_(dead, 0.0)  # (B, H, n)
    log_l = torch.log(l)
    acc["lse"][:, :, r0:r1] = (m + log_l).masked_fill_(dead, float("-inf"))
    if acc["max_weight"] is not None:
        acc["max_weight"][:, :, r0:r1] = inv_l
    if acc["argmax"] is not None:
        acc["argmax"][:, :, r0:r1] = a.masked_fill(dead, -1)
    if u is not None:
        acc["entropy"][:, :, r0:r1] = (log_l - u * inv_l).masked_fill_(dead, 0.0)
    if dsum is not None:
        acc["mean_distance"][:, :, r0:r1] = dsum * inv_l
    if out is not None:
        acc["output"][:, :, r0:r1] = out * inv_l.unsqueeze(-1)
    if acc["received"] is not None:
        rec = acc["received"]
        for idx, (c0, c1, _vis) in enumerate(tiles):
            e = cached[idx]  # (B, H, n, w)
            for b in range(B):  # one matrix-vector product per head: e^T (1 / l), faster than bmm here
                for h in range(H):
                    rec[b, h, c0:c1].addmv_(e[b, h].t(), inv_l[b, h])
            cached[idx] = None


def _write_dead(acc, r0, r1):
    acc["lse"][:, :, r0:r1] = float("-inf")
    for name in ("max_weight", "entropy", "mean_distance", "output"):
        if acc[name] is not None:
            acc[name][:, :, r0:r1] = 0.0
    if acc["argmax"] is not None:
        acc["argmax"][:, :, r0:r1] = -1


def _chunk_streamed(acc, tiles, scores, r0, r1, v, kpos, ct):
    """One query chunk, recomputing score tiles: pass 1 is the online softmax over the key tiles
    (lse, running max and argmax); pass 2 recomputes each tile as P = exp(S - lse)."""
    if not tiles:
        _write_dead(acc, r0, r1)
        return
    need_max = acc["max_weight"] is not None or acc["argmax"] is not None
    need_p2 = any(acc[nm] is not None for nm in ("entropy", "mean_distance", "received", "output"))
    m = l = a = None
    for c0, c1, vis in tiles:
        s = scores(c0, c1, vis)
        if m is None:
            B, H, n, _ = s.shape
            m = torch.full((B, H, n), float("-inf"), dtype=ct, device=s.device)
            l = torch.zeros_like(m)
            a = torch.full((B, H, n), -1, dtype=torch.long, device=s.device) if need_max else None
        tmax, targ = s.max(dim=-1)  # (B, H, n)
        if need_max:
            a = torch.where(tmax > m, targ + c0, a)
        m_new = torch.maximum(m, tmax)
        m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)  # rows that have seen nothing yet
        l = l * torch.exp(m - m_safe) + torch.exp(s - m_safe.unsqueeze(-1)).sum(-1)
        m = m_new
    dead = torch.isneginf(m)  # (B, H, n): rows that see no key
    lse_c = torch.where(dead, float("-inf"), m + torch.log(torch.where(dead, 1.0, l)))
    acc["lse"][:, :, r0:r1] = lse_c
    if acc["max_weight"] is not None:
        acc["max_weight"][:, :, r0:r1] = torch.where(dead, 0.0, torch.exp(m - torch.where(dead, 0.0, lse_c)))
    if acc["argmax"] is not None:
        acc["argmax"][:, :, r0:r1] = a
    if not need_p2:
        return
    lse_safe = torch.where(dead, 0.0, lse_c).unsqueeze(-1)  # (B, H, n, 1)
    ent = torch.zeros_like(m) if acc["entropy"] is not None else None
    dist = torch.zeros_like(m) if acc["mean_distance"] is not None else None
    for c0, c1, vis in tiles:
        logp = scores(c0, c1, vis).sub_(lse_safe).clamp_(min=-1e4)  # log P; masked -> -1e4, exp is 0
        p = torch.exp(logp)  # (B, H, n, w)
        if ent is not None:
            ent -= (p * logp).sum(-1)
        del logp
        if dist is not None:
            dist += _distance_tile(p, r0, r1, c0, c1, kpos)
        if acc["received"] is not None:
            acc["received"][:, :, c0:c1] += p.sum(-2)
        if acc["output"] is not None:
            Hkv = v.shape[1]
            vt = v[:, :, c0:c1].to(ct)  # (B, Hkv, w, Dv)
            acc["output"][:, :, r0:r1] += torch.matmul(p.view(B, Hkv, -1, c1 - c0), vt).view(B, H, n, -1)
    if ent is not None:
        acc["entropy"][:, :, r0:r1] = ent
    if dist is not None:
        acc["mean_distance"][:, :, r0:r1] = dist


# -- method "sdpa" -----------------------------------------------------------------------------------

def _sdpa_ops():
    try:
        return (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    except (AttributeError, RuntimeError):  # pragma: no cover - depends on the torch build
        raise BackendUnsupportedError(
            f"method='sdpa' needs torch's CPU flash kernel (aten::_scaled_dot_product_flash_attention_for_cpu), "
            f"which torch {torch.__version__} does not provide; use method='tiled'"
        ) from None


def _sdpa(q, k, v, spec: AttentionSpec, mask, scale: float, want: set[str], ct: torch.dtype):
    if spec.device.type != "cpu":
        raise BackendUnsupportedError(f"method='sdpa' uses torch's CPU flash kernel; tensors are on {spec.device}. "
                                      "Use method='tiled'")
    fwd, bwd = _sdpa_ops()
    B, H, Lq, D = q.shape
    Hkv, G, Lk = spec.kv_heads, spec.group, spec.kv_len
    dev = q.device
    # The kernel needs one head size for q, k and v, so q and k get one zero column and
    # v := [K, positions] rides along with the same width; the explicit scale keeps the scores.
    qp = torch.nn.functional.pad(q.to(ct), (0, 1))  # (B, H, Lq, D+1)
    kx = k.to(ct)
    if G > 1:
        kx = kx[:, :, None].expand(B, Hkv, G, Lk, D).reshape(B, H, Lk, D)  # (B, H, Lk, D): kv head per query head
    kp = torch.nn.functional.pad(kx, (0, 1))  # (B, H, Lk, D+1)
    pos = torch.arange(Lk, device=dev, dtype=ct)
    vp = torch.cat([kx, pos.view(1, 1, Lk, 1).expand(B, H, Lk, 1)], -1)  # (B, H, Lk, D+1): [K, j]
    del kx

    attn_mask = None
    is_causal = spec.causal
    visible_rows = None  # (B?, H?, Lq) bool, None = every row sees a key
    if mask is not None:
        if isinstance(mask, MaskFn):
            vis = mask.dense(B, H, Lq, Lk, device=dev)  # (Bm, Hm, Lq, Lk)
        else:
            vis = mask
        if spec.causal:
            vis = vis & torch.ones(Lq, Lk, dtype=torch.bool, device=dev).tril_()
            is_causal = False
        attn_mask = torch.zeros(vis.shape, dtype=ct, device=dev).masked_fill_(~vis, float("-inf"))
        visible_rows = vis.any(-1)
    out, lse = fwd(qp, kp, vp, 0.0, is_causal, attn_mask=attn_mask, scale=scale)  # (B, H, Lq, D+1), (B, H, Lq)
    lse = lse.to(ct)
    visible = torch.ones(B, H, Lq, dtype=torch.bool, device=dev)
    if visible_rows is not None:
        visible = visible & visible_rows
        lse = lse.masked_fill(~visible, float("-inf"))
    res = {"lse": lse, "visible": visible}
    if "entropy" in want:
        # H_i = lse_i - scale * q_i . (P K)_i
        ent = lse - scale * (q.to(ct) * out[..., :D]).sum(-1)
        res["entropy"] = ent.masked_fill(~visible, 0.0)
    if "mean_distance" in want:
        ppos = out[..., D]  # sum_j P_ij j
        qi = torch.arange(Lq, device=dev, dtype=ct)
        if spec.causal:  # every visible key has j <= i
            md = qi - ppos
        else:
            # keys j <= i in a second call; its lse says how much of the row's mass they hold
            if attn_mask is None:
                lo_mask, lo_causal, lo_rows = None, True, None
            else:
                lo_vis = vis & torch.ones(Lq, Lk, dtype=torch.bool, device=dev).tril_()
                lo_mask = torch.zeros(lo_vis.shape, dtype=ct, device=dev).masked_fill_(~lo_vis, float("-inf"))
                lo_causal, lo_rows = False, lo_vis.any(-1)
                del lo_vis
            out_lo, lse_lo = fwd(qp, kp, vp, 0.0, lo_causal, attn_mask=lo_mask, scale=scale)
            del lo_mask
            w_lo = torch.exp(lse_lo.to(ct) - torch.where(visible, lse, 0.0))  # share of mass on j <= i
            if lo_rows is not None:
                w_lo = w_lo.masked_fill(~lo_rows, 0.0)
            pos_lo = w_lo * out_lo[..., D]  # sum_{j <= i} P_ij j
            # sum_{j<=i} P_ij (i - j) + sum_{j>i} P_ij (j - i)
            md = (qi * w_lo - pos_lo) + (ppos - pos_lo) - qi * (1 - w_lo)
        res["mean_distance"] = md.masked_fill(~visible, 0.0)
    if "received" in want:
        # sum_i P_ij = d sum(out) / d v_j (any value column): the kernel's fused backward
        ones = torch.ones_like(out)
        lse_k = torch.where(visible, lse, 0.0).contiguous()
        _gq, _gk, gv = bwd(ones, qp, kp, vp, out, lse_k, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
        res["received"] = gv[..., 0].contiguous()  # (B, H, Lk)
    if v is not None:
        o = torch.nn.functional.scaled_dot_product_attention(
            q.to(ct), k.to(ct), v.to(ct), attn_mask=None if attn_mask is None else attn_mask,
            is_causal=is_causal, scale=scale, enable_gqa=G > 1)
        res["output"] = o.masked_fill(~visible.unsqueeze(-1), 0.0)
    return res


# -- the public function ---------------------------------------------------------------------------

def attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | MaskFn | Callable | None = None,
    causal: bool = False,
    scale: float | None = None,
    stats: Sequence[str] | str | None = None,
    key_positions: Sequence[int] | torch.Tensor | None = None,
    query_rows: Sequence[int] | torch.Tensor | None = None,
    block_k: int = 512,
    block_q: int | None = None,
    method: Method = "tiled",
    cache_bytes: int = DEFAULT_CACHE_BYTES,
) -> AttentionStats:
    """Per-head attention statistics in O(n) memory, never holding the ``(Lq, Lk)`` map.

    Args:
        q: ``(batch, heads, q_len, head_dim)``.
        k: ``(batch, kv_heads, kv_len, head_dim)``; query head ``h`` reads kv head
            ``h // (heads // kv_heads)``.
        v: optional ``(batch, kv_heads, kv_len, v_dim)``; when given the attention output is
            returned too (``AttentionStats.output``), computed in the same pass.
        mask: boolean tensor broadcastable to ``(batch, heads, q_len, kv_len)`` (True = may attend)
            or a mask function (:mod:`headlab.masks`), as in :func:`headlab.attention`.
        causal: torch's ``is_causal`` (top-left aligned).
        scale: defaults to ``1/sqrt(head_dim)``.
        stats: names from :data:`STATS` (a list or one name); ``None`` = every statistic the
            method supports, ``key_mass`` only when ``key_positions`` is given and ``rows`` only
            when ``query_rows`` is given.
        key_positions: key positions whose mass each query puts on them (the first token, a
            separator): ``(M,)`` shared by the batch, or ``(batch, M)`` per batch element (a
            separator moves with padding). Gives ``key_mass`` ``(B, H, Lq, M)``.
        query_rows: ``(R,)`` query positions whose full weight rows are returned (``rows``).
        block_k: key tile width.
        block_q: query rows per chunk; default chooses it so that one ``(B, H, block_q, block_k)``
            tile is about 16 MiB.
        method: ``"tiled"`` (every statistic) or ``"sdpa"`` (torch's fused kernel through the
            identities of REFERENCES.md section 3; no ``max_weight`` / ``argmax``). See the module
            docstring.
        cache_bytes: method ``"tiled"`` keeps a query chunk's score tiles between its two passes
            when they take at most this many bytes (0: always recompute them).

    Returns:
        :class:`AttentionStats`; fully masked query rows follow the rule in the module docstring.

    Raises:
        ShapeError, DTypeError, MaskError: as :func:`headlab.attention` does for bad tensors.
        ConfigError: unknown statistic or method, bad block sizes or positions.
        BackendUnsupportedError: a statistic the chosen method cannot compute.
    """
    if method not in ("tiled", "sdpa"):
        raise ConfigError(f"unknown method {method!r}; use 'tiled' (every statistic) or 'sdpa' (torch's fused kernel)")
    for name, val in (("block_k", block_k), ("block_q", block_q)):
        if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val <= 0):
            raise ConfigError(f"{name} must be a positive integer, got {val!r}")
    if not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise ConfigError(f"cache_bytes must be a non-negative integer, got {cache_bytes!r}")
    want = _wanted(stats, method, key_positions, query_rows)
    if isinstance(k, torch.Tensor) and k.dim() == 4:
        v_check = v if v is not None else k.new_empty(()).expand(*k.shape[:-1], 1)  # (B, Hkv, Lk, 1) view
    else:
        v_check = v if v is not None else k
    spec, norm_mask = validate(q, k, v_check, mask=mask, causal=causal)
    scale = default_scale(spec.head_dim) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ConfigError(f"scale must be a finite number, got {scale}")
    ct = torch.float64 if spec.dtype == torch.float64 else torch.float32
    kp = _index_tensor("key_positions", key_positions, spec.kv_len, spec.batch, per_batch_ok=True) \
        if key_positions is not None else None
    qr = _index_tensor("query_rows", query_rows, spec.q_len, spec.batch, per_batch_ok=False) \
        if query_rows is not None else None
    kp = kp.to(spec.device) if kp is not None else None
    qr = qr.to(spec.device) if qr is not None else None

    with torch.no_grad():
        if method == "tiled":
            bq = block_q or _auto_block_q(spec, block_k, cache_bytes, 8 if ct == torch.float64 else 4)
            res = _tiled(q, k, v, spec, norm_mask, scale, want, ct, bq, block_k, cache_bytes)
            res["visible"] = ~torch.isneginf(res["lse"])
        else:
            res = _sdpa(q, k, v, spec, norm_mask, scale, want, ct)
        lse = res["lse"]
        if "key_mass" in want:
            res["key_mass"] = _probs_at(q, k, spec, norm_mask, scale, ct, lse, None, kp)  # (B, H, Lq, M)
        if "rows" in want:
            res["rows"] = _probs_at(q, k, spec, norm_mask, scale, ct, lse, qr, None)  # (B, H, R, Lk)
    kept = {name: res.get(name) for name in STATS if name in want}
    return AttentionStats(**kept, output=res.get("output"), key_positions=kp, query_rows=qr,
                          visible=res["visible"], method=method)
