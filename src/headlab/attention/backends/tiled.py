"""``"tiled"``: exact attention over key tiles with an online softmax (FlashAttention on the CPU).

Nothing ``q_len x kv_len`` is ever held: the forward pass walks the key tiles of each query
block, keeping per query row a running maximum ``m``, normaliser ``l`` and accumulator ``acc``
(REFERENCES.md section 2); it saves the output and the log-sum-exp ``lse = m + log l``. The
backward pass recomputes each tile's probabilities ``P = exp(S - lse)`` from ``q``, ``k`` and
``lse`` and accumulates ``dq``, ``dk``, ``dv`` tile by tile. Memory is linear in the sequence.

Which tiles are visited comes from a :class:`~headlab.attention.blocks.BlockMap`::

    causal, q_len=6, kv_len=6, 2x2 tiles          a tile is
        k0-1 k2-3 k4-5                              EMPTY   (.) skipped: no matmul at all
    q0-1   P    .    .                              PARTIAL (P) computed, element-wise mask applied
    q2-3   F    P    .                              FULL    (F) computed, no mask work
    q4-5   F    F    P

Layout inside this file (the public API keeps ``(B, H, T, D)``): the ``G = heads // kv_heads``
query heads that share a kv head are stacked along the query axis, so one batched matmul per
tile serves a whole group and K/V are never copied per query head::

    q (B, H, Lq, D) -> (B, Hkv, G, Lq, D) -> (B, Hkv, Lq, G, D) -> (B*Hkv, Lq*G, D)   rows = (pos, g)

Speed (docs/tiled.md has the measurements): the running maximum is taken exactly on the first
key tile of each query block and then kept ("stale"): later tiles compute
``exp2(log2(e) * scale * q k^T - m)`` with ``-m`` folded into the matmul (an extra query column
against a row of ones in K^T), and the row sums come out of the value matmul through a column of
ones appended to V. That leaves one element-wise pass (``exp2_``) per tile. Because the softmax
is shift invariant this is exact as long as nothing overflows; a query block whose result is not
finite (a later tile 88 logits above the first one) or has an empty row is recomputed with the
textbook per-tile rescaling. Under ``causal`` a key tile stops at its query block's end, and only
the columns past the block's first query are masked. The forward runs its work units (a query
block x a few heads) in a pool of ``torch.get_num_threads()`` Python threads with single-threaded
torch ops inside (torch releases the GIL in its ops), each reusing one score-tile buffer; torch's
thread count is set to 1 for the duration of the call and restored after (other threads of the
process that run torch ops meanwhile run them single-threaded too). The backward runs serially
with torch's own intra-op threads.

Float16/bfloat16 inputs are computed in float32 (accumulation in float32); float64 stays
float64. A query row that sees no key returns zeros and gets zero gradients.

    >>> import torch
    >>> from headlab.attention.backends.tiled import tiled_attention
    >>> q = torch.randn(1, 4, 37, 16); k = v = torch.randn(1, 2, 50, 16)      # GQA: 4 heads, 2 kv heads
    >>> out, lse = tiled_attention(q, k, v, causal=True, block_q=16, block_k=16, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([1, 4, 37, 16]), torch.Size([1, 4, 37]))
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    >>> torch.allclose(out, ref, atol=1e-5)
    True
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from headlab.attention.backends._threads import run_units
from headlab.attention.backends.base import Backend, Capabilities, register
from headlab.attention.blocks import EMPTY, FULL, PARTIAL
from headlab.attention.guard import check_fits
from headlab.attention.masks import MaskFn, causal as _causal_mask
from headlab.attention.spec import AttentionSpec, default_scale, validate
from headlab.errors import ConfigError

# Default tile: query positions x key positions per tile. Chosen by measurement (docs/tiled.md).
BLOCK_Q = 256
BLOCK_K = 512

__all__ = ["BLOCK_Q", "BLOCK_K", "TiledBackend", "tile_states", "tiled_attention", "working_set_bytes"]


# ------------------------------------------------------------------------------------------
# The plan: tiles, their states, and the element-wise mask of a partial tile
# ------------------------------------------------------------------------------------------

@dataclass
class _Plan:
    """Everything about one call that is not a tensor with a gradient."""

    B: int
    H: int
    Hkv: int
    G: int
    Lq: int
    Lk: int
    D: int
    Dv: int
    scale: float
    causal: bool
    mask: torch.Tensor | MaskFn | None  # normalised: 4-D bool (broadcastable) or MaskFn
    block_q: int
    block_k: int
    states: list[list[int]]  # (n_qb, n_kb) EMPTY/PARTIAL/FULL, combined over batch and heads
    dropout_p: float
    seed: int
    cdtype: torch.dtype  # compute dtype: float64 for float64 inputs, else float32
    _hidden: dict = field(default_factory=dict, repr=False)  # hidden() per tile (causal only)

    @property
    def n_qb(self) -> int:
        return len(self.states)

    def q_rows(self, qb: int) -> tuple[int, int]:
        """Query positions [i0, i1) of query block ``qb``."""
        i0 = qb * self.block_q
        return i0, min(self.Lq, i0 + self.block_q)

    def k_cols(self, kb: int, i1: int | None = None) -> tuple[int, int]:
        """Key positions [j0, j1) of key tile ``kb``; under ``causal``, for the query block
        ending at ``i1``, cut at ``i1`` (no row of the block sees a key at or past it)."""
        j0 = kb * self.block_k
        j1 = min(self.Lk, j0 + self.block_k)
        if self.causal and i1 is not None:
            j1 = min(j1, i1)
        return j0, j1

    def hidden(self, i0: int, i1: int, j0: int, j1: int, device) -> torch.Tensor:
        """``~visible(...)``, kept per tile when it is the same for every (batch, head) (causal
        without a mask): every head's unit of the tile reuses it."""
        if self.mask is not None or not self.causal:
            return ~self.visible(i0, i1, j0, j1, device)
        key = (i0, i1, j0, j1, str(device))
        hid = self._hidden.get(key)
        if hid is None:
            hid = ~self.visible(i0, i1, j0, j1, device)
            self._hidden[key] = hid
        return hid

    def visible(self, i0: int, i1: int, j0: int, j1: int, device) -> torch.Tensor:
        """Bool ``(Bm, Hm', (i1-i0)*G, j1-j0)`` (broadcastable to the tile viewed as
        ``(B, Hkv, rows, cols)``): which entries of a partial tile may be attended to."""
        G = self.G
        vis = None
        if self.mask is not None:
            if isinstance(self.mask, MaskFn):
                m = self.mask
                bm = self.B if m.batch_dependent else 1
                hm = self.H if m.head_dependent else 1
                b = torch.arange(bm, device=device).view(bm, 1, 1, 1)
                h = torch.arange(hm, device=device).view(1, hm, 1, 1)
                qi = torch.arange(i0, i1, device=device).view(1, 1, -1, 1)
                ki = torch.arange(j0, j1, device=device).view(1, 1, 1, -1)
                vis = torch.broadcast_to(m.evaluate(b, h, qi, ki, self.Lq, self.Lk), (bm, hm, i1 - i0, j1 - j0))
            else:
                t = self.mask  # (Bm, Hm, Lq or 1, Lk or 1)
                t = t[:, :, i0:i1] if t.shape[2] != 1 else t
                t = t[:, :, :, j0:j1] if t.shape[3] != 1 else t
                vis = t.expand(t.shape[0], t.shape[1], i1 - i0, j1 - j0)
        if self.causal:
            tri = (torch.arange(i0, i1, device=device).view(-1, 1)
                   >= torch.arange(j0, j1, device=device).view(1, -1)).view(1, 1, i1 - i0, j1 - j0)
            vis = tri if vis is None else vis & tri
        bm, hm = vis.shape[0], vis.shape[1]
        if hm == 1:
            # (Bm, 1, nq, nk) -> (Bm, 1, nq, G, nk) -> (Bm, 1, nq*G, nk)
            vis = vis.unsqueeze(3).expand(bm, 1, i1 - i0, G, j1 - j0).reshape(bm, 1, (i1 - i0) * G, j1 - j0)
        else:
            # (Bm, H, nq, nk) -> (Bm, Hkv, G, nq, nk) -> (Bm, Hkv, nq, G, nk) -> (Bm, Hkv, nq*G, nk)
            vis = (vis.reshape(bm, self.Hkv, G, i1 - i0, j1 - j0).transpose(2, 3)
                   .reshape(bm, self.Hkv, (i1 - i0) * G, j1 - j0))
        return vis

    def keep(self, qb: int, kb: int, shape, device) -> torch.Tensor:
        """The dropout keep-mask of tile (qb, kb): a pure function of (seed, tile), so the
        backward pass regenerates exactly the forward's mask."""
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed * 1_000_003 + qb * 65_537 + kb) % (1 << 63))
        return torch.rand(shape, generator=gen, device=device, dtype=torch.float32) >= self.dropout_p


def _tensor_mask_states(mask: torch.Tensor, Lq: int, Lk: int, bq: int, bk: int) -> torch.Tensor:
    """EMPTY/PARTIAL/FULL per tile of a bool mask ``(Bm, Hm, Lq or 1, Lk or 1)``."""
    n_qb, n_kb = -(-Lq // bq), -(-Lk // bk)
    m = mask
    sq = bq if m.shape[2] != 1 else 1
    sk = bk if m.shape[3] != 1 else 1
    nq = n_qb if m.shape[2] != 1 else 1
    nk = n_kb if m.shape[3] != 1 else 1
    pad = (0, nk * sk - m.shape[3], 0, nq * sq - m.shape[2])
    shape = (m.shape[0], m.shape[1], nq, sq, nk, sk)
    any_b = torch.nn.functional.pad(m, pad, value=False).reshape(shape).any(dim=5).any(dim=3)
    all_b = torch.nn.functional.pad(m, pad, value=True).reshape(shape).all(dim=5).all(dim=3)
    st = torch.where(all_b, FULL, torch.where(any_b, PARTIAL, EMPTY)).to(torch.int8)
    return st.expand(m.shape[0], m.shape[1], n_qb, n_kb)


def tile_states(spec: AttentionSpec, mask: torch.Tensor | MaskFn | None, block_q: int, block_k: int) -> torch.Tensor:
    """Tile states ``(n_q_blocks, n_kv_blocks)`` (int8 EMPTY=0 / PARTIAL=1 / FULL=2) of a call,
    combined over batch and heads: a tile is skipped only when it is empty for every
    (batch, head), and unmasked only when it is full for every one.

        >>> import torch
        >>> from headlab.attention.spec import validate
        >>> q = torch.zeros(1, 1, 6, 4)
        >>> spec, m = validate(q, q, q, causal=True)
        >>> tile_states(spec, m, 2, 2).tolist()
        [[1, 0, 0], [2, 1, 0], [2, 2, 1]]
    """
    Lq, Lk = spec.q_len, spec.kv_len
    n_qb, n_kb = -(-Lq // block_q), -(-Lk // block_k)
    states = torch.full((n_qb, n_kb), FULL, dtype=torch.int8)
    parts = []
    if isinstance(mask, MaskFn):
        parts.append(mask.block_map(Lq, Lk, block_q, block_k, batch=spec.batch, heads=spec.heads).state.cpu())
    elif isinstance(mask, torch.Tensor):
        parts.append(_tensor_mask_states(mask.cpu(), Lq, Lk, block_q, block_k))
    if spec.causal:
        parts.append(_causal_mask().block_map(Lq, Lk, block_q, block_k).state.cpu())
    for st in parts:
        st = st.reshape(-1, n_qb, n_kb)
        lo, hi = st.amin(0), st.amax(0)
        combined = torch.where(hi == EMPTY, EMPTY, torch.where(lo == FULL, FULL, PARTIAL)).to(torch.int8)
        states = torch.minimum(states, combined)  # AND of visibilities: EMPTY < PARTIAL < FULL
    return states


def _make_plan(spec, mask, scale, dropout_p, seed, block_q, block_k) -> _Plan:
    if not (isinstance(block_q, int) and isinstance(block_k, int)) or block_q <= 0 or block_k <= 0:
        raise ConfigError(f"block_q and block_k must be positive integers, got block_q={block_q!r}, block_k={block_k!r}")
    states = tile_states(spec, mask, block_q, block_k).tolist()
    cdtype = torch.float64 if spec.dtype == torch.float64 else torch.float32
    if dropout_p > 0 and seed is None:
        seed = int(torch.randint(0, 1 << 62, (1,)).item())  # drawn from torch's RNG: manual_seed reproduces it
    return _Plan(B=spec.batch, H=spec.heads, Hkv=spec.kv_heads, G=spec.group, Lq=spec.q_len, Lk=spec.kv_len,
                 D=spec.head_dim, Dv=spec.v_dim, scale=scale, causal=spec.causal, mask=mask,
                 block_q=block_q, block_k=block_k, states=states, dropout_p=float(dropout_p),
                 seed=int(seed or 0), cdtype=cdtype)


# ------------------------------------------------------------------------------------------
# Layout changes
# ------------------------------------------------------------------------------------------

def _to_rows(x: torch.Tensor, p: _Plan) -> torch.Tensor:
    """``(B, H, Lq, E) -> (B*Hkv, Lq*G, E)``, rows ordered (position, group member)."""
    B, H, L, E = x.shape
    if p.G == 1:
        return x.reshape(B * H, L, E)
    return x.view(B, p.Hkv, p.G, L, E).transpose(2, 3).reshape(B * p.Hkv, L * p.G, E)  # (B*Hkv, L*G, E)


def _from_rows(x: torch.Tensor, p: _Plan) -> torch.Tensor:
    """``(B*Hkv, Lq*G, E) -> (B, H, Lq, E)``."""
    E = x.shape[-1]
    if p.G == 1:
        return x.view(p.B, p.H, p.Lq, E)
    return x.view(p.B, p.Hkv, p.Lq, p.G, E).transpose(2, 3).reshape(p.B, p.H, p.Lq, E)


def _prepare(q, k, v, p: _Plan, q_factor: float = 1.0, with_q: bool = True):
    """Scaled query rows with a free last column ``(BHkv, Lq*G, D+1)``, K^T with a row of ones
    ``(BHkv, D+1, Lk)`` and V with a column of ones ``(BHkv, Lk, Dv+1)``, in the compute dtype.

    Writing ``-m`` (a per-row shift) into the query's last column makes one matmul return
    ``scale * q k^T - m``; the ones column of V makes the value matmul return the row sums too.
    ``q_factor`` multiplies the scale (the forward passes ``log2(e)`` to work in base 2).
    Without ``with_q`` the query is left to the caller (``None``; see :func:`_query_block`).
    """
    BHkv = p.B * p.Hkv
    qa = None
    if with_q:
        qa = torch.empty(BHkv, p.Lq * p.G, p.D + 1, dtype=p.cdtype, device=q.device)  # (BHkv, Lq*G, D+1)
        qa[..., : p.D] = _to_rows(q, p)
        qa[..., : p.D].mul_(p.scale * q_factor)
        qa[..., p.D] = 0.0
    # K is stored as rows [k | 1] (BHkv, Lk, D+1) and used through its transposed view, so key
    # tiles are sliced without a power-of-two leading dimension (measured neutral, docs/tiled.md).
    ka = torch.empty(BHkv, p.Lk, p.D + 1, dtype=p.cdtype, device=k.device)  # (BHkv, Lk, D+1)
    ka[..., : p.D] = k.reshape(BHkv, p.Lk, p.D)
    ka[..., p.D] = 1.0
    ka = ka.transpose(1, 2)  # (BHkv, D+1, Lk) view
    vaug = torch.empty(BHkv, p.Lk, p.Dv + 1, dtype=p.cdtype, device=v.device)  # (BHkv, Lk, Dv+1)
    vaug[..., : p.Dv] = v.reshape(BHkv, p.Lk, p.Dv)
    vaug[..., p.Dv] = 1.0
    return qa, ka, vaug


def _mask_tile(s: torch.Tensor, p: _Plan, i0, i1, j0, j1, h0: int = 0) -> None:
    """Set the invisible entries of a partial score tile ``(n, rows, cols)`` to -inf, in place;
    ``s`` holds the flattened (batch, kv head) slices ``[h0, h0 + n)`` of ``(B*Hkv, ...)``."""
    n, rows, cols = s.shape
    if p.mask is None and p.causal and i0 >= j0:  # keys j <= i0 are seen by every row: skip them
        c0 = min(cols, i0 + 1 - j0)
        s, j0 = s[:, :, c0:], j0 + c0
        cols = s.shape[2]
        if cols == 0:
            return
    hid = p.hidden(i0, i1, j0, j1, s.device)  # (Bm, Hm', rows, cols)
    if hid.shape[0] == 1 and hid.shape[1] == 1:
        s.masked_fill_(hid[0, 0], float("-inf"))  # same for every (batch, head): broadcast
    elif n == p.B * p.Hkv:
        s.view(p.B, p.Hkv, rows, cols).masked_fill_(hid, float("-inf"))
    else:  # a slice of the flattened (batch, kv head) axis
        hid = hid.expand(p.B, p.Hkv, rows, cols).reshape(p.B * p.Hkv, rows, cols)[h0:h0 + n]
        s.masked_fill_(hid, float("-inf"))



# ------------------------------------------------------------------------------------------
# Query blocks in parallel threads
# ------------------------------------------------------------------------------------------

# Work unit of the forward: one query block x as many flattened (batch, kv head) slices as keep
# its score tile near this many entries (2 MiB in float32). Measured at 4,096 tokens, 2 threads,
# 256x512 tiles (docs/tiled.md): 1 head per unit pays Python overhead per op, all 8 heads (8 MiB
# tile) fall out of cache; 2 to 4 heads were fastest.
UNIT_ELEMS = 1 << 19


def _head_chunk(p: _Plan) -> int:
    return max(1, UNIT_ELEMS // (p.block_q * p.G * p.block_k))


def _units(p: _Plan, chunk: int) -> list[tuple[int, int, int]]:
    """``(qb, h0, h1)`` work units, the most expensive first (most visited tiles), so that a
    dynamic schedule ends with the cheap ones."""
    BHkv = p.B * p.Hkv
    work = [sum(1 for s in row if s != EMPTY) for row in p.states]
    order = sorted(range(p.n_qb), key=lambda qb: -work[qb])
    return [(qb, h0, min(BHkv, h0 + chunk)) for qb in order for h0 in range(0, BHkv, chunk)]


def _run_blocks(block, p: _Plan, chunk: int) -> None:
    """Call ``block(qb, h0, h1)`` for every work unit. With more than one torch thread and more
    than one unit, the units run in a pool of ``torch.get_num_threads()`` Python threads, each
    running single-threaded torch ops (torch releases the GIL inside ops). This replaces one
    OpenMP parallel region (and its barrier) per medium-sized op by one per call, and lets each
    thread keep a small tile in its own core's cache. torch's thread count is restored after."""
    run_units(lambda u: block(*u), _units(p, chunk), threaded=not _THREADED_OFF)


_THREADED_OFF = False

# ------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _forward_block_fast(qb_rows, kt, vaug, p: _Plan, qb: int, out_rows, lse_rows, h0: int = 0, sbuf=None) -> bool:
    """One query block with the stale maximum, in base 2 (``qb_rows`` carries
    ``scale * log2(e)``; ``exp2`` is cheaper than ``exp``). Writes ``out_rows (n, r, Dv)`` and
    ``lse_rows (n, r)`` (natural log); returns False when the block must be recomputed exactly.
    ``h0``: first flattened (batch, kv head) index of these rows (for masks). ``sbuf``: a flat
    scratch tensor of at least ``n * r * block_k`` entries for the score tile (reused: a fresh
    multi-MiB tensor per tile costs page faults that made the score matmul twice as slow)."""
    i0, i1 = p.q_rows(qb)
    BHkv, r, _ = qb_rows.shape
    Dv = p.Dv
    acc = torch.zeros(BHkv, r, Dv + 1, dtype=p.cdtype, device=qb_rows.device)  # [P V | rowsum P]
    negm = None
    for kb, state in enumerate(p.states[qb]):
        if state == EMPTY:
            continue
        j0, j1 = p.k_cols(kb, i1)
        s = torch.bmm(qb_rows, kt[:, :, j0:j1],  # (n, r, c) = log2(e) scale q k^T - m (last q column)
                      out=None if sbuf is None else sbuf[: BHkv * r * (j1 - j0)].view(BHkv, r, j1 - j0))
        if state == PARTIAL:
            _mask_tile(s, p, i0, i1, j0, j1, h0)
        if negm is None:  # first visited tile: its exact row maximum becomes the shift m
            negm = s.amax(-1, keepdim=True).neg_()  # (BHkv, r, 1)
            negm.masked_fill_(torch.isinf(negm), 0.0)  # a row empty in this tile: shift 0
            s.add_(negm)
            qb_rows[..., -1:] = negm
        s.exp2_()
        if p.dropout_p > 0:
            acc[..., Dv] += s.sum(-1)
            s.masked_fill_(~p.keep(qb, kb, s.shape, s.device), 0.0)
            acc[..., :Dv].baddbmm_(s, vaug[:, j0:j1, :Dv], alpha=1.0 / (1.0 - p.dropout_p))
        else:
            acc.baddbmm_(s, vaug[:, j0:j1])  # P V and, through the ones column, rowsum P
        del s
    if negm is None:  # every tile of the block is empty
        out_rows.zero_()
        lse_rows.fill_(float("inf"))
        return True
    l = acc[..., Dv]
    if not bool(torch.isfinite(acc).all()) or bool((l <= 0).any()):
        return False
    out_rows.copy_(acc[..., :Dv] / l.unsqueeze(-1))
    lse_rows.copy_(torch.log(l) - negm.squeeze(-1) * _LN2)
    return True


def _forward_block_exact(qb_rows, kt, vaug, p: _Plan, qb: int, out_rows, lse_rows, h0: int = 0) -> None:
    """One query block with the textbook online softmax: exact max per tile and rescaling
    (base 2, like :func:`_forward_block_fast`)."""
    i0, i1 = p.q_rows(qb)
    BHkv, r, _ = qb_rows.shape
    Dv = p.Dv
    acc = torch.zeros(BHkv, r, Dv, dtype=p.cdtype, device=qb_rows.device)
    l = torch.zeros(BHkv, r, 1, dtype=p.cdtype, device=qb_rows.device)
    m = torch.full((BHkv, r, 1), float("-inf"), dtype=p.cdtype, device=qb_rows.device)
    qb_rows[..., -1] = 0.0  # no shift folded into the matmul here
    for kb, state in enumerate(p.states[qb]):
        if state == EMPTY:
            continue
        j0, j1 = p.k_cols(kb, i1)
        s = torch.bmm(qb_rows, kt[:, :, j0:j1])  # (n, r, c), base 2
        if state == PARTIAL:
            _mask_tile(s, p, i0, i1, j0, j1, h0)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
        alpha = torch.exp2(m - m_safe)  # exp2(-inf) = 0 for rows that had nothing
        s.sub_(m_safe).exp2_()
        l.mul_(alpha).add_(s.sum(-1, keepdim=True))
        acc.mul_(alpha)
        if p.dropout_p > 0:
            s.masked_fill_(~p.keep(qb, kb, s.shape, s.device), 0.0)
            acc.baddbmm_(s, vaug[:, j0:j1, :Dv], alpha=1.0 / (1.0 - p.dropout_p))
        else:
            acc.baddbmm_(s, vaug[:, j0:j1, :Dv])
        m = m_new
    dead = l <= 0  # (BHkv, r, 1): rows that see no key
    l_safe = torch.where(dead, torch.ones_like(l), l)
    out_rows.copy_((acc / l_safe).masked_fill_(dead, 0.0))
    lse = torch.where(torch.isinf(m), torch.zeros_like(m), m) * _LN2 + torch.log(l_safe)
    lse_rows.copy_(lse.masked_fill(dead, float("inf")).squeeze(-1))


def _query_block(qg, p: _Plan, qb: int, h0: int, h1: int, buf: torch.Tensor, factor: float) -> torch.Tensor:
    """Rows ``[h0, h1)`` of query block ``qb`` in the layout of :func:`_prepare`'s query,
    ``(n, r, D+1)`` = ``[factor * scale * q | 0]``, written into the flat scratch ``buf`` (in the
    worker thread: no separate pass over the whole query before the pool starts).
    ``qg``: the query viewed as ``(B*Hkv, G, Lq, D)``."""
    i0, i1 = p.q_rows(qb)
    n, nq = h1 - h0, i1 - i0
    rows = buf[: n * nq * p.G * (p.D + 1)].view(n, nq * p.G, p.D + 1)  # (n, r, D+1)
    src = qg[h0:h1, :, i0:i1].transpose(1, 2)  # (n, nq, G, D)
    rows.view(n, nq, p.G, p.D + 1)[..., : p.D].copy_(src)
    rows[..., : p.D].mul_(p.scale * factor)
    rows[..., p.D] = 0.0
    return rows


def _forward(q, k, v, p: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """``out (BHkv, Lq*G, Dv)`` and internal ``lse (BHkv, Lq*G)`` (+inf on rows with no key)."""
    _, kt, vaug = _prepare(q, k, v, p, _LOG2E, with_q=False)  # query blocks: built per unit
    BHkv = p.B * p.Hkv
    out = torch.empty(BHkv, p.Lq * p.G, p.Dv, dtype=p.cdtype, device=q.device)
    lse = torch.empty(BHkv, p.Lq * p.G, dtype=p.cdtype, device=q.device)
    qg = q.reshape(BHkv, p.G, p.Lq, p.D)  # (B, H, Lq, D) -> (B*Hkv, G, Lq, D), a view when contiguous

    chunk = _head_chunk(p) if p.dropout_p == 0 else BHkv
    scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per worker thread: score tile, query block

    def block(qb: int, h0: int, h1: int) -> None:
        i0, i1 = p.q_rows(qb)
        r0, r1 = i0 * p.G, i1 * p.G
        bufs = scratch.get(threading.get_ident())
        if bufs is None:
            rows = min(chunk, BHkv) * min(p.block_q, p.Lq) * p.G
            bufs = (torch.empty(rows * min(p.block_k, p.Lk), dtype=p.cdtype, device=q.device),
                    torch.empty(rows * (p.D + 1), dtype=p.cdtype, device=q.device))
            scratch[threading.get_ident()] = bufs
        sbuf, qbuf = bufs
        qb_rows = _query_block(qg, p, qb, h0, h1, qbuf, _LOG2E)  # its last column: the shift, per block
        args = (qb_rows, kt[h0:h1], vaug[h0:h1], p, qb, out[h0:h1, r0:r1], lse[h0:h1, r0:r1], h0)
        if not _forward_block_fast(*args, sbuf=sbuf):
            _forward_block_exact(*args)

    # dropout draws one keep-mask per whole tile (the backward regenerates it): no head split
    _run_blocks(block, p, chunk)
    return out, lse


# ------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------

def _backward(q, k, v, out, lse, dout, p: _Plan):
    """Gradients ``dq (B, H, Lq, D)``, ``dk (B, Hkv, Lk, D)``, ``dv (B, Hkv, Lk, Dv)`` recomputed
    tile by tile: P = exp(scale q k^T - lse); dV += P^T dO; dS = P * (dO V^T - D); dQ += dS K;
    dK += dS^T Q (Q carries the scale)."""
    qs, kt, vaug = _prepare(q, k, v, p)
    BHkv, Dv = p.B * p.Hkv, p.Dv
    do = _to_rows(dout, p).to(p.cdtype)  # (BHkv, Lq*G, Dv)
    # dO augmented with -D, D = rowsum(dO * O): then [dO | -D] @ [V | 1]^T = dO V^T - D
    doaug = torch.empty(BHkv, p.Lq * p.G, Dv + 1, dtype=p.cdtype, device=q.device)
    doaug[..., :Dv] = do
    doaug[..., Dv] = -(do * out).sum(-1)
    # -lse in the query's last column: the score matmul returns scale q k^T - lse. Rows that see
    # no key (lse = +inf) get a huge finite shift instead of -inf (inf * 0 inside BLAS is NaN): P = 0.
    qs[..., p.D] = torch.clamp(-lse, min=-1e30)
    dq = torch.zeros(BHkv, p.Lq * p.G, p.D, dtype=p.cdtype, device=q.device)
    dk = torch.zeros(BHkv, p.Lk, p.D, dtype=p.cdtype, device=q.device)
    dv = torch.zeros(BHkv, p.Lk, Dv, dtype=p.cdtype, device=q.device)
    k_rows = kt[:, : p.D].transpose(1, 2)  # (BHkv, Lk, D)
    keep_scale = 1.0 / (1.0 - p.dropout_p) if p.dropout_p > 0 else 1.0
    for qb in range(p.n_qb):
        i0, i1 = p.q_rows(qb)
        r0, r1 = i0 * p.G, i1 * p.G
        qb_rows, do_b, doaug_b = qs[:, r0:r1], do[:, r0:r1], doaug[:, r0:r1]
        qb_scaled = qb_rows[..., : p.D]  # (BHkv, r, D): scale * q
        dq_b = dq[:, r0:r1]
        for kb, state in enumerate(p.states[qb]):
            if state == EMPTY:
                continue
            j0, j1 = p.k_cols(kb, i1)
            s = torch.bmm(qb_rows, kt[:, :, j0:j1])  # (BHkv, r, c) = scale q k^T - lse
            if state == PARTIAL:
                _mask_tile(s, p, i0, i1, j0, j1)
            prob = s.exp_()  # P, exact softmax probabilities of the tile
            if p.dropout_p > 0:
                keep = p.keep(qb, kb, prob.shape, prob.device)
                pd = prob.masked_fill(~keep, 0.0)
                dv[:, j0:j1].baddbmm_(pd.transpose(1, 2), do_b, alpha=keep_scale)
                ds = torch.bmm(do_b, vaug[:, j0:j1, :Dv].transpose(1, 2))  # dO V^T
                ds.masked_fill_(~keep, 0.0).mul_(keep_scale).add_(doaug_b[..., Dv:]).mul_(prob)
            else:
                dv[:, j0:j1].baddbmm_(prob.transpose(1, 2), do_b)  # dV += P^T dO
                ds = torch.bmm(doaug_b, vaug[:, j0:j1].transpose(1, 2)).mul_(prob)  # P * (dO V^T - D)
            dq_b.baddbmm_(ds, k_rows[:, j0:j1])  # dQ += dS K   (scale applied at the end)
            dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), qb_scaled)  # dK += dS^T (scale Q)
            del s, prob, ds
    dq.mul_(p.scale)
    return _from_rows(dq, p), dk.view(p.B, p.Hkv, p.Lk, p.D), dv.view(p.B, p.Hkv, p.Lk, Dv)


class _TiledAttention(torch.autograd.Function):
    """Saves q, k, v, the output and the log-sum-exp: O(n) memory, nothing n x n."""

    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan):
        out, lse = _forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return _from_rows(out, plan).to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        p = ctx.plan
        dq, dk, dv = _backward(q, k, v, out, lse, dout, p)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _run(q, k, v, spec: AttentionSpec, mask, scale: float, dropout_p: float, seed, block_q, block_k):
    plan = _make_plan(spec, mask, scale, dropout_p, seed, block_q, block_k)
    out, lse = _TiledAttention.apply(q, k, v, plan)
    return out, lse, plan


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask=None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    return_lse: bool = False,
):
    """Exact attention in O(n) memory; same conventions as :func:`headlab.attention`.

    Args:
        q: ``(batch, heads, q_len, head_dim)``.
        k: ``(batch, kv_heads, kv_len, head_dim)``; ``heads % kv_heads == 0`` (GQA, no copies).
        v: ``(batch, kv_heads, kv_len, v_dim)``.
        mask: bool tensor broadcastable to ``(batch, heads, q_len, kv_len)`` (True = may attend)
            or a mask function; tiles it hides entirely are skipped, tiles it shows entirely
            are computed without element-wise masking.
        causal: torch's ``is_causal`` (top-left); tiles above the diagonal are skipped.
        scale: defaults to ``1/sqrt(head_dim)``.
        dropout_p: dropout on the probabilities. The keep-mask of each tile is drawn from a
            generator seeded by ``(seed, tile)``, so backward regenerates it exactly.
        seed: dropout seed; default drawn from torch's RNG (``torch.manual_seed`` reproduces it).
        block_q, block_k: query positions and key positions per tile.
        return_lse: also return the log-sum-exp ``(batch, heads, q_len)`` in float32 (float64
            for float64 inputs); ``-inf`` on rows that see no key.

    Returns:
        ``out (batch, heads, q_len, v_dim)`` in the input dtype, and ``lse`` when asked.

        >>> import torch
        >>> q = k = v = torch.randn(1, 2, 5, 8)
        >>> out = tiled_attention(q, k, v, mask=torch.zeros(5, 5, dtype=torch.bool))
        >>> float(out.abs().max())          # no visible key anywhere: zeros, not NaN
        0.0
    """
    spec, norm = validate(q, k, v, mask=mask, causal=causal, dropout_p=dropout_p)
    scale = default_scale(spec.head_dim) if scale is None else float(scale)
    out, lse, plan = _run(q, k, v, spec, norm, scale, dropout_p, seed, block_q, block_k)
    if not return_lse:
        return out
    lse = _from_rows(lse.unsqueeze(-1), plan).squeeze(-1)  # (B, H, Lq)
    return out, lse.masked_fill(torch.isinf(lse) & (lse > 0), float("-inf"))


# ------------------------------------------------------------------------------------------
# Memory and the backend
# ------------------------------------------------------------------------------------------

def working_set_bytes(spec: AttentionSpec, block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
                      *, backward: bool | None = None) -> int:
    """Peak extra bytes of one call, all O(n) except the tile: the scaled query copy, K and V in
    the compute dtype (V with a ones column), output and log-sum-exp, the score tile and its
    mask (under ``causal`` the diagonal tiles' masks, kept for the call), the accumulator; with ``backward`` (default: ``spec.requires_grad``) the
    recomputation's dO copy, dq/dk/dv accumulators and a second tile (dS)."""
    c = 8 if spec.dtype == torch.float64 else 4
    B, H, Hkv, Lq, Lk, D, Dv = spec.batch, spec.heads, spec.kv_heads, spec.q_len, spec.kv_len, spec.head_dim, spec.v_dim
    rows = min(block_q, Lq) * spec.group
    cols = min(block_k, Lk)
    tile = B * Hkv * rows * cols * c
    kcopy = 0 if c == spec.itemsize else B * Hkv * Lk * D * c
    fwd = (B * H * Lq * D * c  # scaled q
           + kcopy + B * Hkv * Lk * (Dv + 1) * c  # K, [V | 1]
           + B * H * Lq * (Dv + 1) * c  # out + lse
           + tile + B * Hkv * rows * cols  # scores and the bool mask of a partial tile
           + B * Hkv * rows * (Dv + 1) * c  # accumulator
           + (Lq * min(block_q, Lq) if spec.causal else 0))  # kept causal masks of diagonal tiles
    if backward is None:
        backward = spec.requires_grad
    if not backward:
        return fwd
    bwd = (B * H * Lq * (Dv + 1) * c  # [dO | -D]
           + B * H * Lq * (D + Dv) * c  # dO copy, dq
           + B * Hkv * Lk * (D + Dv) * c  # dk, dv
           + tile)  # dS beside P
    return fwd + bwd


@register
class TiledBackend(Backend):
    name = "tiled"
    summary = "exact online-softmax attention over key tiles, O(n) memory, custom backward (FlashAttention on CPU)"
    capabilities = Capabilities(returns_weights=False, materializes=False)
    priority = 10  # auto prefers torch's fused kernel whenever it serves the call
    alternative = "sdpa"

    def __init__(self, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> None:
        """The registry holds one with the default tile; build another for other tile shapes,
        e.g. ``headlab.attention(q, k, v, backend=TiledBackend(64, 128))``."""
        if not (isinstance(block_q, int) and isinstance(block_k, int)) or block_q <= 0 or block_k <= 0:
            raise ConfigError(f"block_q and block_k must be positive integers, got {block_q!r}, {block_k!r}")
        self.block_q, self.block_k = block_q, block_k

    def check_memory(self, spec: AttentionSpec) -> None:
        check_fits(working_set_bytes(spec, self.block_q, self.block_k), what=f"backend 'tiled' at {spec.q_len}x{spec.kv_len}",
                   device=spec.device, alternative=None)

    def forward(self, q, k, v, spec, *, mask, scale):
        out, _lse, _plan = _run(q, k, v, spec, mask, scale, spec.dropout_p, None, self.block_q, self.block_k)
        return out, None
