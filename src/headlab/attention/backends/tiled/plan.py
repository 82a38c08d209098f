"""The plan of one tiled call: its tiles and their states, the element-wise work of a partial
tile (mask, additive bias, score modification), and the row layout of the kernel.

Layout inside the kernel (the public API keeps ``(B, H, T, D)``): the ``G = heads // kv_heads``
query heads that share a kv head are stacked along the query axis, so one batched matmul per
tile serves a whole group and K/V are never copied per query head::

    q (B, H, Lq, D) -> (B, Hkv, G, Lq, D) -> (B, Hkv, Lq, G, D) -> (B*Hkv, Lq*G, D)   rows = (pos, g)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import headlab.checks as checks
from headlab.spec import visibility
from headlab.spec.attention_spec import AttentionSpec
from headlab.spec.masks import MaskFn
from headlab.spec.score_mods import ScoreMod

# Default tile: query positions x key positions per tile. Chosen by measurement (docs/tiled.md).
BLOCK_Q = 256
BLOCK_K = 512


def check_blocks(block_q, block_k) -> None:
    """The one validation of tile sizes (the function and the backend class both call it)."""
    checks.positive_int("block_q", block_q)
    checks.positive_int("block_k", block_k)


@dataclass
class Plan:
    """Everything about one call that is not a tensor with a gradient."""

    spec: AttentionSpec
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
    mask: torch.Tensor | MaskFn | None  # normalised: 4-D bool or float (broadcastable) or MaskFn
    score_mod: ScoreMod | None
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

    @property
    def elementwise(self) -> bool:
        """Whether partial tiles need more than hiding entries (an additive mask or a score_mod):
        then the kernel takes its exact path."""
        return self.score_mod is not None or visibility.is_additive(self.mask)

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

    def _to_tile(self, t: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """``(Bm, Hm, nq, nk)`` -> ``(Bm, Hm', nq*G, nk)``, broadcastable to the tile viewed as
        ``(B, Hkv, rows, cols)``."""
        G, nq, nk = self.G, i1 - i0, j1 - j0
        bm, hm = t.shape[0], t.shape[1]
        t = t.expand(bm, hm, nq, nk)
        if hm == 1:  # (Bm, 1, nq, nk) -> (Bm, 1, nq, G, nk) -> (Bm, 1, nq*G, nk)
            return t.unsqueeze(3).expand(bm, 1, nq, G, nk).reshape(bm, 1, nq * G, nk)
        # (Bm, H, nq, nk) -> (Bm, Hkv, G, nq, nk) -> (Bm, Hkv, nq, G, nk) -> (Bm, Hkv, nq*G, nk)
        return t.reshape(bm, self.Hkv, G, nq, nk).transpose(2, 3).reshape(bm, self.Hkv, nq * G, nk)

    def hidden(self, i0: int, i1: int, j0: int, j1: int, device) -> torch.Tensor:
        """``~visible`` of a tile, ``(Bm, Hm', rows, cols)``; kept per tile when it is the same for
        every (batch, head) (causal without a mask): every head's unit of the tile reuses it."""
        if self.mask is not None or not self.causal:
            vis = visibility.visible(self.spec, self.mask, (i0, i1), (j0, j1))
            assert vis is not None  # called for partial tiles only
            return ~self._to_tile(vis, i0, i1, j0, j1)
        key = (i0, i1, j0, j1, str(device))
        hid = self._hidden.get(key)
        if hid is None:
            vis = visibility.visible(self.spec, None, (i0, i1), (j0, j1))
            assert vis is not None  # causal: a partial tile hides some pair
            hid = self._hidden[key] = ~self._to_tile(vis, i0, i1, j0, j1)
        return hid

    def bias(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """Additive bias of a tile (0 / -inf and a float mask's values), ``(Bm, Hm', rows, cols)``."""
        b = visibility.additive_bias(self.spec, self.mask, (i0, i1), (j0, j1), dtype=self.cdtype)
        return self._to_tile(b, i0, i1, j0, j1)

    def keep(self, qb: int, kb: int, shape, device) -> torch.Tensor:
        """The dropout keep-mask of tile (qb, kb): a pure function of (seed, tile), so the
        backward pass regenerates exactly the forward's mask."""
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed * 1_000_003 + qb * 65_537 + kb) % (1 << 63))
        return torch.rand(shape, generator=gen, device=device, dtype=torch.float32) >= self.dropout_p


def tile_states(spec: AttentionSpec, mask, block_q: int, block_k: int, score_mod=None) -> torch.Tensor:
    """Tile states ``(n_q_blocks, n_kv_blocks)`` (int8 EMPTY / PARTIAL / FULL) the kernel walks;
    see :func:`headlab.spec.visibility.tile_states`.

        >>> import torch
        >>> from headlab.spec.attention_spec import validate
        >>> q = torch.zeros(1, 1, 6, 4)
        >>> spec, m = validate(q, q, q, causal=True)
        >>> tile_states(spec, m, 2, 2).tolist()
        [[1, 0, 0], [2, 1, 0], [2, 2, 1]]
    """
    return visibility.tile_states(spec, mask, block_q, block_k, extra_partial=score_mod is not None)


def make_plan(spec, mask, scale, dropout_p, seed, block_q, block_k, score_mod=None) -> Plan:
    check_blocks(block_q, block_k)
    states = tile_states(spec, mask, block_q, block_k, score_mod).tolist()
    cdtype = torch.float64 if spec.dtype == torch.float64 else torch.float32
    if dropout_p > 0 and seed is None:
        seed = int(torch.randint(0, 1 << 62, (1,)).item())  # drawn from torch's RNG: manual_seed reproduces it
    return Plan(
        spec=spec,
        B=spec.batch,
        H=spec.heads,
        Hkv=spec.kv_heads,
        G=spec.group,
        Lq=spec.q_len,
        Lk=spec.kv_len,
        D=spec.head_dim,
        Dv=spec.v_dim,
        scale=scale,
        causal=spec.causal,
        mask=mask,
        score_mod=score_mod,
        block_q=block_q,
        block_k=block_k,
        states=states,
        dropout_p=float(dropout_p),
        seed=int(seed or 0),
        cdtype=cdtype,
    )


# -- layout changes ---------------------------------------------------------------------------


def to_rows(x: torch.Tensor, p: Plan) -> torch.Tensor:
    """``(B, H, Lq, E) -> (B*Hkv, Lq*G, E)``, rows ordered (position, group member)."""
    B, H, L, E = x.shape
    if p.G == 1:
        return x.reshape(B * H, L, E)
    return x.view(B, p.Hkv, p.G, L, E).transpose(2, 3).reshape(B * p.Hkv, L * p.G, E)  # (B*Hkv, L*G, E)


def from_rows(x: torch.Tensor, p: Plan) -> torch.Tensor:
    """``(B*Hkv, Lq*G, E) -> (B, H, Lq, E)``."""
    E = x.shape[-1]
    if p.G == 1:
        return x.view(p.B, p.H, p.Lq, E)
    return x.view(p.B, p.Hkv, p.Lq, p.G, E).transpose(2, 3).reshape(p.B, p.H, p.Lq, E)


def prepare_kv(k, v, p: Plan):
    """K^T with a row of ones ``(BHkv, D+1, Lk)`` and V with a column of ones ``(BHkv, Lk, Dv+1)``,
    in the compute dtype. A per-row shift ``-m`` written into a query's last column makes one
    matmul return ``scale * q k^T - m``; the ones column of V makes the value matmul return the
    row sums too."""
    BHkv = p.B * p.Hkv
    # K is stored as rows [k | 1] (BHkv, Lk, D+1) and used through its transposed view, so key
    # tiles are sliced without a power-of-two leading dimension (measured neutral, docs/tiled.md).
    ka = torch.empty(BHkv, p.Lk, p.D + 1, dtype=p.cdtype, device=k.device)  # (BHkv, Lk, D+1)
    ka[..., : p.D] = k.reshape(BHkv, p.Lk, p.D)
    ka[..., p.D] = 1.0
    vaug = torch.empty(BHkv, p.Lk, p.Dv + 1, dtype=p.cdtype, device=v.device)  # (BHkv, Lk, Dv+1)
    vaug[..., : p.Dv] = v.reshape(BHkv, p.Lk, p.Dv)
    vaug[..., p.Dv] = 1.0
    return ka.transpose(1, 2), vaug  # (BHkv, D+1, Lk) view, (BHkv, Lk, Dv+1)


def scaled_query(q, p: Plan) -> torch.Tensor:
    """``[scale * q | 0]`` as rows ``(BHkv, Lq*G, D+1)`` in the compute dtype: the same values,
    rounded the same way, as the forward's query blocks (:func:`query_block`), so that the
    backward recomputes exactly the forward's scores."""
    qa = torch.empty(p.B * p.Hkv, p.Lq * p.G, p.D + 1, dtype=p.cdtype, device=q.device)  # (BHkv, Lq*G, D+1)
    qa[..., : p.D] = to_rows(q, p)
    qa[..., : p.D].mul_(p.scale)
    qa[..., p.D] = 0.0
    return qa


def query_block(qg, p: Plan, qb: int, h0: int, h1: int, buf: torch.Tensor) -> torch.Tensor:
    """Rows ``[h0, h1)`` of query block ``qb`` as ``(n, r, D+1)`` = ``[scale * q | 0]``, written
    into the flat scratch ``buf`` (in the worker thread: no pass over the whole query before the
    pool starts). ``qg``: the query viewed as ``(B*Hkv, G, Lq, D)``."""
    i0, i1 = p.q_rows(qb)
    n, nq = h1 - h0, i1 - i0
    rows = buf[: n * nq * p.G * (p.D + 1)].view(n, nq * p.G, p.D + 1)  # (n, r, D+1)
    src = qg[h0:h1, :, i0:i1].transpose(1, 2)  # (n, nq, G, D)
    rows.view(n, nq, p.G, p.D + 1)[..., : p.D].copy_(src)
    rows[..., : p.D].mul_(p.scale)
    rows[..., p.D] = 0.0
    return rows


# -- the element-wise work of a partial tile ----------------------------------------------------


def _slice_heads(t: torch.Tensor, p: Plan, n: int, h0: int) -> torch.Tensor:
    """A ``(Bm, Hm', rows, cols)`` tile tensor for the flattened (batch, kv head) slices ``[h0, h0+n)``:
    ``(1, rows, cols)`` when it is the same for all, else ``(n, rows, cols)``."""
    rows, cols = t.shape[-2:]
    if t.shape[0] == 1 and t.shape[1] == 1:
        return t[0]
    return t.expand(p.B, p.Hkv, rows, cols).reshape(p.B * p.Hkv, rows, cols)[h0 : h0 + n]


def mask_tile(s: torch.Tensor, p: Plan, i0, i1, j0, j1, h0: int = 0) -> None:
    """Set the invisible entries of a partial score tile ``(n, rows, cols)`` to -inf, in place
    (a float mask's values are added instead); ``s`` holds the flattened (batch, kv head) slices
    ``[h0, h0 + n)`` of ``(B*Hkv, ...)``."""
    n = s.shape[0]
    if p.mask is None and not p.causal:  # partial only through a score_mod: nothing hidden
        return
    if visibility.is_additive(p.mask):
        s.add_(_slice_heads(p.bias(i0, i1, j0, j1), p, n, h0))
        return
    if p.mask is None and p.causal and i0 >= j0:  # keys j <= i0 are seen by every row: skip them
        c0 = min(s.shape[2], i0 + 1 - j0)
        s, j0 = s[:, :, c0:], j0 + c0
        if s.shape[2] == 0:
            return
    s.masked_fill_(_slice_heads(p.hidden(i0, i1, j0, j1, s.device), p, n, h0), float("-inf"))


def index_grid(p: Plan, i0, i1, j0, j1, h0: int, n: int, device):
    """FlexAttention's ``(b, h, q_idx, kv_idx)`` for a tile of rows ``(pos, g)``, broadcastable to
    ``(n, rows, cols)`` (the flattened (batch, kv head) slices ``[h0, h0 + n)``)."""
    bh = torch.arange(h0, h0 + n, device=device)  # flattened (batch, kv head)
    b = (bh // p.Hkv).view(n, 1, 1, 1)
    g = torch.arange(p.G, device=device).view(1, 1, p.G, 1)
    h = ((bh % p.Hkv) * p.G).view(n, 1, 1, 1) + g  # (n, 1, G, 1) query head
    qi = torch.arange(i0, i1, device=device).view(1, -1, 1, 1)
    kv = torch.arange(j0, j1, device=device).view(1, 1, 1, -1)
    nq = i1 - i0
    r = lambda t: t.expand(n, nq, p.G, t.shape[-1]).reshape(n, nq * p.G, t.shape[-1])
    return r(b), r(h), r(qi), kv.view(1, 1, -1)


def modify_scores(s: torch.Tensor, p: Plan, i0, i1, j0, j1, h0: int = 0) -> torch.Tensor:
    """``score_mod(s, b, h, q_idx, kv_idx)`` on a tile of natural-unit scores ``(n, rows, cols)``."""
    b, h, qi, kv = index_grid(p, i0, i1, j0, j1, h0, s.shape[0], s.device)
    assert p.score_mod is not None  # called only for a plan with a score_mod
    return p.score_mod(s, b, h, qi, kv)
