"""``"linear"``: kernelised (linear) attention, an approximation of softmax attention.

Softmax attention weighs key ``j`` for query ``i`` by ``exp(q_i . k_j * scale)``; linear
attention (Katharopoulos et al. 2020) uses a product of non-negative features instead,
``phi(q_i) . phi(k_j)``, so that the sums over keys are shared by every query::

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j))
            \\_________ state S: (F, d_v) _/       \\___ z: (F,) __/

Non-causal: ``S`` and ``z`` are summed once over all keys, O(n F d_v) time, no n x n map.
Causal (query i sees keys 0..i): chunked prefix sums. The sequence is cut into chunks of C
positions; each chunk's state ``sum_{j in chunk} phi(k_j) v_j^T`` is summed, an exclusive
prefix sum over chunks gives what each chunk inherits from the ones before it, and within a
chunk the masked quadratic form ``tril(phi(Q_c) phi(K_c)^T) V_c`` adds the rest::

    chunk:      c0        c1        c2
    keys:    [k0 k1]   [k2 k3]   [k4 k5]
    query q3 = phi(q3) . (S_c0)            <- inherited state, (F, d_v)
             + phi(q3) . phi(k2) v2 + phi(q3) . phi(k3) v3   <- masked C x C block of c1

Memory: the chunk states ``(n / C) x F x d_v`` plus the ``n x C`` blocks, i.e. O(n (F + C))
for C >= d_v, never O(n F d_v) (one state per position) nor O(n^2). Gradients are taken by
autograd through the same computation, which saves tensors of the same sizes.
The denominator rides along as an extra all-ones column of ``v``.

Feature maps (:mod:`headlab.attention.feature_maps`): ``elu`` (``elu(x) + 1``, the default:
``backend="linear"`` means it), ``relu``, and ``favor`` (Performer's FAVOR+, ``num_features``
positive orthogonal random features that estimate ``exp(q . k * scale)`` without bias; the
draw is seeded, fixed unless :meth:`LinearBackend.redraw` is called, or redrawn every
``redraw_every`` calls while the backend is in training mode). ``scale`` matters only to
FAVOR+; ``elu`` and ``relu`` apply ``phi`` to q and k as given (as Katharopoulos et al. do).

Masks: only key padding is possible without the n x n map: a boolean mask broadcast over
queries (shape ``(B, 1, 1, Lk)`` or ``(B, H, 1, Lk)``) or a mask function that does not look
at the query position (:func:`headlab.masks.padding`); ``causal=True`` is its own path. Any
other mask is refused with :class:`~headlab.errors.BackendUnsupportedError`. A query whose
features meet no key (every key padded; ``relu`` with all-negative features) outputs zeros.

Decoding: :meth:`LinearBackend.step` carries a :class:`LinearState` per (batch, kv head),
one token at a time, and equals the causal parallel form.

    >>> import torch, headlab
    >>> from headlab.attention.backends.linear import LinearBackend, from_string
    >>> q, k, v = (torch.randn(1, 4, 10, 8, dtype=torch.float64) for _ in range(3))
    >>> out = headlab.attention(q, k, v, causal=True, backend="linear")       # elu + 1
    >>> fav = from_string("favor:64")
    >>> fav
    <headlab backend 'linear' favor:64 seed=0>
    >>> headlab.attention(q, k, v, backend=fav).shape
    torch.Size([1, 4, 10, 8])
    >>> lin = LinearBackend()                        # decode token by token: same as causal
    >>> state, outs = None, []
    >>> for t in range(10):
    ...     o, state = lin.step(q[:, :, t], k[:, :, t], v[:, :, t], state)
    ...     outs.append(o)
    >>> torch.allclose(torch.stack(outs, dim=2), out)
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from headlab.attention import feature_maps
from headlab.attention.backends.base import Backend, Capabilities, register
from headlab.attention.guard import check_fits
from headlab.attention.masks import MaskFn
from headlab.attention.spec import AttentionSpec, default_scale, validate
from headlab.errors import BackendUnsupportedError, ConfigError, ShapeError

FeatureMapName = Literal["elu", "relu", "favor"]

_ALIASES = {"elu": "elu", "elu+1": "elu", "linear": "elu", "relu": "relu",
            "favor": "favor", "favor+": "favor", "performer": "favor"}
DEFAULT_FAVOR_FEATURES = 256
DEFAULT_CHUNK = 64

__all__ = ["LinearBackend", "LinearConfig", "LinearState", "from_string", "working_set_bytes"]


@dataclass(frozen=True)
class LinearConfig:
    """How a :class:`LinearBackend` computes. Validated on construction."""

    feature_map: FeatureMapName = "elu"  # elu + 1 is Katharopoulos et al.'s map and the default
    num_features: int | None = None  # FAVOR+ random features m; elu/relu have head_dim features
    seed: int = 0  # FAVOR+ draw; the same seed gives the same projection on every machine
    chunk_size: int = DEFAULT_CHUNK  # causal chunk C: memory O(n (F + C)) when C >= d_v
    redraw_every: int = 0  # FAVOR+ in training mode: new features every N calls (0: never)

    def __post_init__(self) -> None:
        fm = _ALIASES.get(str(self.feature_map).lower())
        if fm is None:
            raise ConfigError(f"unknown feature map {self.feature_map!r}; use one of elu, relu, favor")
        object.__setattr__(self, "feature_map", fm)
        if fm == "favor":
            m = DEFAULT_FAVOR_FEATURES if self.num_features is None else self.num_features
            if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
                raise ConfigError(
                    f"FAVOR+ needs a positive whole number of random features, got num_features={m!r}; "
                    f"try num_features={DEFAULT_FAVOR_FEATURES} (more features: smaller error, more time)"
                )
            object.__setattr__(self, "num_features", m)
        elif self.num_features is not None:
            raise ConfigError(
                f"feature map {fm!r} has head_dim features; num_features={self.num_features!r} applies to "
                "favor only (e.g. LinearBackend('favor', num_features=256))"
            )
        for name in ("chunk_size",):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {val!r}")
        if isinstance(self.redraw_every, bool) or not isinstance(self.redraw_every, int) or self.redraw_every < 0:
            raise ConfigError(f"redraw_every must be an integer >= 0 (0: never), got {self.redraw_every!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")

    def label(self) -> str:
        if self.feature_map == "favor":
            return f"favor:{self.num_features} seed={self.seed}"
        return self.feature_map

    def features(self, head_dim: int) -> int:
        """Number of features F for a head dim: ``head_dim`` for elu/relu, ``num_features`` for favor."""
        return self.num_features if self.feature_map == "favor" else head_dim


@dataclass
class LinearState:
    """Recurrent state of causal linear attention, per (batch, kv head).

    ``kv = sum_j phi(k_j) v_j^T * exp(-offset)`` ``(B, Hkv, F, d_v)``,
    ``z = sum_j phi(k_j) * exp(-offset)`` ``(B, Hkv, F)``; ``offset`` ``(B, Hkv)`` is a running
    maximum of FAVOR+ key exponents kept out of the sums so they cannot overflow (zeros for
    elu/relu; it cancels in the output). ``position`` counts the tokens seen.
    """

    kv: torch.Tensor
    z: torch.Tensor
    offset: torch.Tensor
    position: int = 0


def _mix_seed(*parts: int) -> int:
    """One 63-bit seed from several integers (splitmix64 over each in turn): nearby inputs give
    unrelated streams, the same inputs the same stream."""
    x = 0
    for part in parts:
        x = (x ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x >> 1


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Features and sums run in float32 for half inputs (sums of n positive terms overflow fp16)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def working_set_bytes(spec: AttentionSpec, num_features: int | None = None,
                      chunk_size: int = DEFAULT_CHUNK) -> int:
    """Peak extra bytes of one forward call (no grad), output included.

    Non-causal: the features of q and k, the ``F x d_v`` state and the output. Causal (chunk C,
    N = n / C chunks, E = d_v + 1): features, v with its ones column, and the larger of the prefix
    phase (chunk states, their running sums and the exclusive prefix: ``3 N F E``) and the block
    phase (prefix, ``n x C`` blocks, two ``n x E`` partial outputs). No term grows as ``n^2`` or
    ``n F d_v``. Measured peaks agree within a few percent (``benchmarks/bench_linear.py``)."""
    Fn = num_features or spec.head_dim
    s = torch.empty((), dtype=_compute_dtype(spec.dtype)).element_size()
    B, H, Hk, Lq, Lk, Dv = spec.batch, spec.heads, spec.kv_heads, spec.q_len, spec.kv_len, spec.v_dim
    E = Dv + 1
    if not spec.causal:
        total = B * (H * Lq + Hk * Lk) * Fn  # features (FAVOR+ exponentiates its projections in place)
        total += B * Hk * Fn * E + B * H * Lq * E  # states, output and its denominator
        return total * s
    C = min(chunk_size, Lq)
    N = -(-Lq // C)
    L = N * C
    total = B * (H + Hk) * L * Fn + B * Hk * L * E  # features, v with its ones column (padded to L)
    states = B * Hk * N * Fn * E
    total += max(3 * states, states + B * H * L * C + 2 * B * H * L * E)
    return total * s


@register
class LinearBackend(Backend):
    """Linear attention; ``LinearBackend()`` is elu + 1, the instance registered as ``"linear"``.

    Args:
        feature_map: ``"elu"`` (default), ``"relu"`` or ``"favor"`` (aliases ``"elu+1"``,
            ``"favor+"``, ``"performer"``).
        num_features: FAVOR+ random features m (default 256); not allowed for elu/relu.
        seed: FAVOR+ draw; fixed until :meth:`redraw`.
        chunk_size: causal chunk length C.
        redraw_every: FAVOR+ only: in training mode (:meth:`train`), draw new features every
            this many forward calls (Performer redraws periodically while training); 0 = never.
            In eval mode (the default) the features never change by themselves.
    """

    name = "linear"
    summary = "linear attention phi(q)(phi(k)^T v): elu+1 (default), relu, FAVOR+; approximate"
    capabilities = Capabilities(dropout=False, returns_weights=False, exact=False, materializes=False,
                                additive_mask=False, returns_lse=False)
    priority = 900
    alternative = "sdpa"

    def __init__(self, feature_map: str = "elu", *, num_features: int | None = None, seed: int = 0,
                 chunk_size: int = DEFAULT_CHUNK, redraw_every: int = 0) -> None:
        self.config = LinearConfig(feature_map, num_features, seed, chunk_size, redraw_every)  # type: ignore[arg-type]
        self.training = False
        self._draw = 0  # how many redraws so far
        self._calls = 0  # forward calls in training mode since the last automatic redraw
        self._proj: dict[int, torch.Tensor] = {}  # head_dim -> float64 CPU projection
        self._proj_cast: dict[tuple, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"<headlab backend 'linear' {self.config.label()}>"

    @property
    def feature_map(self) -> str:
        return self.config.feature_map

    def num_features(self, head_dim: int) -> int:
        return self.config.features(head_dim)

    # -- FAVOR+ projection ------------------------------------------------------------------
    def projection(self, head_dim: int, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The current FAVOR+ matrix ``W``: ``(num_features, head_dim)``. Same seed, same draw."""
        if self.config.feature_map != "favor":
            raise ConfigError(f"feature map {self.config.feature_map!r} has no random projection; use 'favor'")
        w = self._proj.get(head_dim)
        if w is None:
            gen = torch.Generator().manual_seed(_mix_seed(self.config.seed, self._draw, head_dim))
            w = feature_maps.orthogonal_gaussian(self.config.num_features, head_dim, gen)
            self._proj[head_dim] = w
        key = (head_dim, str(device), dtype)
        cast = self._proj_cast.get(key)
        if cast is None:
            cast = w.to(device=device, dtype=dtype)
            self._proj_cast[key] = cast
        return cast

    def redraw(self) -> None:
        """Draw new FAVOR+ features (the next draw of this seed's sequence: reproducible)."""
        if self.config.feature_map != "favor":
            raise ConfigError(f"redraw() applies to FAVOR+ random features; feature map {self.config.feature_map!r} "
                              "is deterministic")
        self._draw += 1
        self._calls = 0
        self._proj.clear()
        self._proj_cast.clear()

    def train(self, mode: bool = True) -> LinearBackend:
        """Training mode: with ``redraw_every=N`` FAVOR+ features are redrawn every N calls."""
        self.training = bool(mode)
        return self

    def eval(self) -> LinearBackend:
        """Eval mode: features stay fixed (only an explicit :meth:`redraw` changes them)."""
        return self.train(False)

    def _maybe_redraw(self) -> None:
        if self.training and self.config.redraw_every and self.config.feature_map == "favor":
            if self._calls >= self.config.redraw_every:
                self.redraw()
            self._calls += 1

    # -- backend interface ------------------------------------------------------------------
    def supports(self, spec: AttentionSpec) -> tuple[bool, str]:
        ok, why = super().supports(spec)
        if not ok:
            return ok, why
        if spec.mask_kind == "bool" and spec.mask_shape is not None and spec.mask_shape[2] != 1:
            return False, (
                f"linear attention takes only key padding masks, got a boolean mask of shape {spec.mask_shape} "
                "that varies with the query position; give it shape (batch, 1, 1, kv_len) or "
                "(batch, heads, 1, kv_len), use headlab.masks.padding(lengths), or causal=True for causal masking"
            )
        return True, ""

    def check_memory(self, spec: AttentionSpec) -> None:
        fm = self.config.num_features if self.config.feature_map == "favor" else None
        check_fits(working_set_bytes(spec, fm, self.config.chunk_size),
                   what=f"backend 'linear' at {spec.q_len}x{spec.kv_len}", device=spec.device,
                   alternative=None)

    def forward(self, q, k, v, spec, *, mask, scale, score_mod=None):
        self._maybe_redraw()
        key_mask = _key_mask(spec, mask)  # (Bm, Hm, Lk) or None
        cdt = _compute_dtype(q.dtype)
        q_, k_, v_ = q.to(cdt), k.to(cdt), v.to(cdt)
        group = spec.group
        if key_mask is not None and key_mask.shape[1] > 1 and group > 1:
            # a mask per query head: query heads of a group see different keys; give each its own copy
            k_ = k_.repeat_interleave(group, dim=1)  # (B, H, Lk, D)
            v_ = v_.repeat_interleave(group, dim=1)  # (B, H, Lk, Dv)
            group = 1
        fq, fk = self._features(q_, k_, scale, key_mask)  # (B, H, Lq, F), (B, Hk, Lk, F)
        if spec.causal:
            out = _causal(fq, fk, v_, group, self.config.chunk_size)
        else:
            out = _noncausal(fq, fk, v_, group)
        return out.to(q.dtype), None, None

    def _features(self, q: torch.Tensor, k: torch.Tensor, scale: float,
                  key_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``phi(q)`` ``(B, H, Lq, F)`` and ``phi(k)`` ``(B, Hk, Lk, F)``, masked keys zeroed.

        Each may be off by a positive factor per query row (queries) or per (batch, kv head)
        (keys): both cancel between numerator and denominator, and keep ``exp`` in range.
        """
        km = None if key_mask is None else key_mask.unsqueeze(-1)  # (Bm, Hm, Lk, 1)
        fm = self.config.feature_map
        if fm != "favor":
            phi = feature_maps.elu if fm == "elu" else feature_maps.relu
            fq, fk = phi(q), phi(k)
            if km is not None:
                fk = fk.masked_fill(~km, 0.0)
            return fq, fk
        w = self.projection(q.shape[-1], q.device, q.dtype)  # (m, D)
        s = scale ** 0.5  # exp(q.k * scale) = exp((q s).(k s))
        # queries: exp(W q - |q|^2/2) / sqrt(m) and exp(W q - max_l (W q)_l) differ by a factor per row
        lq = torch.matmul(q, w.T * s)  # (B, H, Lq, m)
        fq = _exp_minus(lq, lq.detach().amax(-1, keepdim=True))
        # keys: exp(W k - |k|^2/2 - shift) with one shift per (batch, kv head) over all keys
        lk = torch.matmul(k, w.T * s)  # (B, Hk, Lk, m)
        half_sq = (0.5 * scale) * (k * k).sum(-1, keepdim=True)  # (B, Hk, Lk, 1)
        top = lk.detach().amax(-1, keepdim=True) - half_sq.detach()  # (B, Hk, Lk, 1): each key's largest exponent
        if km is not None:
            top = top.masked_fill(~km, float("-inf"))
        shift = top.amax(dim=-2, keepdim=True)  # (B, Hk, 1, 1)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        fk = _exp_minus(lk, half_sq + shift, hide=None if km is None else ~km)  # hidden keys: exp(-inf) = 0
        return fq, fk

    # -- diagnostics and decoding ----------------------------------------------------------
    def implied_weights(self, q: torch.Tensor, k: torch.Tensor, rows=None, *, mask=None,
                        causal: bool = False, scale: float | None = None) -> torch.Tensor:
        """The attention weights this backend implies for chosen query rows.

        ``A_ij = phi(q_i) . phi(k_j) / sum_j' phi(q_i) . phi(k_j')`` over the visible keys.

        Args:
            q: ``(B, H, Lq, D)``; k: ``(B, Hkv, Lk, D)``.
            rows: query positions (a list or 1-D tensor); default all.
            mask, causal, scale: as for :func:`headlab.attention`.

        Returns:
            ``(B, H, len(rows), Lk)`` in the compute dtype; each row sums to 1 (or is all 0
            when the query's features meet no key). O(len(rows) * Lk) memory.
        """
        spec, norm = validate(q, k, k[..., :1], mask=mask, causal=causal)
        ok, why = self.supports(spec.with_(requires_grad=False))
        if not ok:
            raise BackendUnsupportedError(f"backend 'linear' cannot serve this call: {why}")
        Lq, Lk = spec.q_len, spec.kv_len
        rows_t = torch.arange(Lq) if rows is None else torch.as_tensor(rows, dtype=torch.long).flatten()
        if rows_t.numel() and (int(rows_t.min()) < 0 or int(rows_t.max()) >= Lq):
            raise ShapeError(f"rows must be query positions in [0, {Lq}), got {rows_t.tolist()[:8]}...")
        rows_t = rows_t.to(q.device)
        scale = default_scale(spec.head_dim) if scale is None else float(scale)
        key_mask = _key_mask(spec, norm)
        cdt = _compute_dtype(q.dtype)
        k_ = k.to(cdt)
        group = spec.group
        if key_mask is not None and key_mask.shape[1] > 1 and group > 1:
            k_, group = k_.repeat_interleave(group, dim=1), 1  # (B, H, Lk, D)
        fq, fk = self._features(q[:, :, rows_t].to(cdt), k_, scale, key_mask)  # (B,H,r,F), (B,Hk,Lk,F)
        B, Hk, r = fq.shape[0], fk.shape[1], fq.shape[2]
        a = torch.matmul(fq.reshape(B, Hk, group * r, -1), fk.transpose(-1, -2))  # (B, Hk, G*r, Lk)
        a = a.view(B, spec.heads, r, Lk)  # (B, H, r, Lk)
        if causal:
            hidden = torch.arange(Lk, device=q.device).view(1, -1) > rows_t.view(-1, 1)  # (r, Lk)
            a = a.masked_fill(hidden, 0.0)
        den = a.sum(-1, keepdim=True)
        return a / torch.where(den > 0, den, torch.ones_like(den))

    def step(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, state: LinearState | None = None,
             *, scale: float | None = None) -> tuple[torch.Tensor, LinearState]:
        """One decoding step of causal linear attention.

        Args:
            q_t: ``(B, H, D)`` (or ``(B, H, 1, D)``), the new query of every head.
            k_t: ``(B, Hkv, D)`` (or ``(B, Hkv, 1, D)``); v_t: ``(B, Hkv, Dv)`` (or 4-D).
            state: from the previous step; None starts a sequence.

        Returns:
            ``(out_t, state)``: ``out_t`` ``(B, H, Dv)`` (4-D if ``q_t`` was), equal to row t of
            ``headlab.attention(q, k, v, causal=True, backend=self)``; O(F d_v) state per head.
        """
        four = q_t.dim() == 4
        if four:
            if q_t.shape[2] != 1 or k_t.dim() != 4 or v_t.dim() != 4 or k_t.shape[2] != 1 or v_t.shape[2] != 1:
                raise ShapeError(f"step takes one token: got q_t {tuple(q_t.shape)}, k_t {tuple(k_t.shape)}, "
                                 f"v_t {tuple(v_t.shape)}; slice with x[:, :, t]")
            q_t, k_t, v_t = q_t[:, :, 0], k_t[:, :, 0], v_t[:, :, 0]
        if q_t.dim() != 3 or k_t.dim() != 3 or v_t.dim() != 3:
            raise ShapeError(f"step expects q_t (B, H, D), k_t (B, Hkv, D), v_t (B, Hkv, Dv); got "
                             f"{tuple(q_t.shape)}, {tuple(k_t.shape)}, {tuple(v_t.shape)}")
        B, H, D = q_t.shape
        Hk = k_t.shape[1]
        if k_t.shape[0] != B or v_t.shape[:2] != k_t.shape[:2] or k_t.shape[2] != D or Hk == 0 or H % Hk:
            raise ShapeError(f"step: q_t {tuple(q_t.shape)}, k_t {tuple(k_t.shape)}, v_t {tuple(v_t.shape)} do not "
                             "fit: batch must agree, k_t must have q_t's head_dim, heads a multiple of kv heads")
        G = H // Hk
        scale = default_scale(D) if scale is None else float(scale)
        cdt = _compute_dtype(q_t.dtype)
        q_, k_, v_ = q_t.to(cdt), k_t.to(cdt), v_t.to(cdt)
        if self.config.feature_map == "favor":
            w = self.projection(D, q_t.device, cdt)
            root, s = math.sqrt(w.shape[0]), scale ** 0.5
            lk = feature_maps.favor_logits(k_ * s, w)  # (B, Hk, m)
            mk = lk.detach().amax(-1)  # (B, Hk)
            offset = mk if state is None else torch.maximum(state.offset, mk)
            fk = torch.exp(lk - offset.unsqueeze(-1)) / root  # (B, Hk, m)
            lq = feature_maps.favor_logits(q_ * s, w)  # (B, H, m)
            fq = torch.exp(lq - lq.detach().amax(-1, keepdim=True)) / root
        else:
            phi = feature_maps.elu if self.config.feature_map == "elu" else feature_maps.relu
            fk, fq = phi(k_), phi(q_)
            offset = torch.zeros(B, Hk, dtype=cdt, device=q_t.device) if state is None else state.offset
        outer = fk.unsqueeze(-1) * v_.unsqueeze(-2)  # (B, Hk, F, Dv)
        if state is None:
            kv, z, pos = outer, fk, 0
        else:
            decay = torch.exp(state.offset - offset)  # (B, Hk): rescale old sums to the new offset
            kv = state.kv * decay[..., None, None] + outer
            z = state.z * decay[..., None] + fk
            pos = state.position
        fqg = fq.view(B, Hk, G, -1)  # (B, Hk, G, F)
        num = torch.matmul(fqg, kv)  # (B, Hk, G, Dv)
        den = (fqg * z.unsqueeze(2)).sum(-1, keepdim=True)  # (B, Hk, G, 1)
        out = (num / torch.where(den > 0, den, torch.ones_like(den))).view(B, H, -1).to(q_t.dtype)
        return (out.unsqueeze(2) if four else out), LinearState(kv, z, offset, pos + 1)


# -- the two computations --------------------------------------------------------------------

def _exp_minus(x: torch.Tensor, shift: torch.Tensor, hide: torch.Tensor | None = None) -> torch.Tensor:
    """``exp(x - shift)``, 0 where ``hide``; in place when autograd does not need ``x``.

    Hidden entries are set to -inf before ``exp`` (not zeroed after), so a large hidden
    exponent cannot overflow into ``inf * 0 = nan`` in the backward pass."""
    if x.requires_grad or shift.requires_grad:
        y = x - shift
        return torch.exp(y if hide is None else y.masked_fill(hide, float("-inf")))
    x = x.sub_(shift)
    return (x if hide is None else x.masked_fill_(hide, float("-inf"))).exp_()


def _normalise(o: torch.Tensor) -> torch.Tensor:
    """``(..., Dv + 1)`` numerator with the denominator last -> ``(..., Dv)``; 0/0 rows -> 0."""
    num, den = o[..., :-1], o[..., -1:]
    return num / torch.where(den > 0, den, torch.ones_like(den))


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    return torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)  # (B, Hk, Lk, Dv + 1)


def _noncausal(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    B, H, Lq, Fn = fq.shape
    Hk = fk.shape[1]
    kv = torch.matmul(fk.transpose(-1, -2), v)  # (B, Hk, F, Dv): the whole state
    z = fk.sum(dim=-2, keepdim=True).transpose(-1, -2)  # (B, Hk, F, 1): the normaliser's state
    fqg = fq.reshape(B, Hk, group * Lq, Fn)  # (B, Hk, G*Lq, F): heads of a group stacked
    num = torch.matmul(fqg, kv).view(B, H, Lq, -1)  # (B, H, Lq, Dv)
    den = torch.matmul(fqg, z).view(B, H, Lq, 1)  # (B, H, Lq, 1)
    den = torch.where(den > 0, den, torch.ones_like(den))  # 0 only when the numerator is 0 too
    return num / den if num.requires_grad else num.div_(den)


def _causal(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, group: int, chunk: int) -> torch.Tensor:
    B, H, Lq, Fn = fq.shape
    Hk = fk.shape[1]
    Lk = min(fk.shape[2], Lq)  # top-left causal: keys at positions >= Lq are never visible
    fk = fk[:, :, :Lk]  # (B, Hk, Lk, F)
    v1 = _with_ones(v[:, :, :Lk])  # (B, Hk, Lk, E)
    E = v1.shape[-1]
    C = min(chunk, Lq)
    N = -(-Lq // C)
    L = N * C
    if L > Lq:
        fq = F.pad(fq, (0, 0, 0, L - Lq))  # (B, H, L, F)
    if L > Lk:
        fk = F.pad(fk, (0, 0, 0, L - Lk))  # (B, Hk, L, F): zero features see nothing
        v1 = F.pad(v1, (0, 0, 0, L - Lk))  # (B, Hk, L, E)
    fkc = fk.view(B, Hk, N, C, Fn)  # (B, Hk, N, C, F)
    vc = v1.view(B, Hk, N, C, E)  # (B, Hk, N, C, E)
    chunk_kv = torch.matmul(fkc.transpose(-1, -2), vc)  # (B, Hk, N, F, E): each chunk's state
    prefix = F.pad(chunk_kv.cumsum(dim=2)[:, :, :-1], (0, 0, 0, 0, 1, 0))  # (B, Hk, N, F, E): chunks before
    del chunk_kv
    # the G query heads sharing a kv head are stacked inside each chunk: (B, Hk, N, G*C, F)
    fqc = fq.view(B, Hk, group, N, C, Fn).transpose(2, 3).reshape(B, Hk, N, group * C, Fn)
    out = torch.matmul(fqc, prefix)  # (B, Hk, N, G*C, E): what earlier chunks contribute
    scores = torch.matmul(fqc, fkc.transpose(-1, -2))  # (B, Hk, N, G*C, C)
    tri = torch.ones(C, C, dtype=torch.bool, device=fq.device).tril_().repeat(group, 1)  # (G*C, C)
    scores.masked_fill_(~tri, 0.0)  # in place: matmul's backward does not need its own output
    out = torch.matmul(scores, vc).add_(out)  # (B, Hk, N, G*C, E): plus the masked block of its own chunk
    out = out.view(B, Hk, N, group, C, E).transpose(2, 3).reshape(B, H, L, E)[:, :, :Lq]  # (B, H, Lq, E)
    return _normalise(out)


def _key_mask(spec: AttentionSpec, mask: torch.Tensor | MaskFn | None) -> torch.Tensor | None:
    """The key padding as ``(Bm, Hm, Lk)`` bool, or None. Refuses masks that depend on the query."""
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        return mask[:, :, 0, :]  # supports() checked: (Bm, Hm, 1, Lk)
    dev = spec.device
    bm = spec.batch if mask.batch_dependent else 1
    hm = spec.heads if mask.head_dependent else 1
    b = torch.arange(bm, device=dev).view(bm, 1, 1, 1)
    h = torch.arange(hm, device=dev).view(1, hm, 1, 1)
    probe = torch.tensor([0, spec.q_len - 1], device=dev).view(1, 1, 2, 1)  # two queries: does it look?
    kv = torch.arange(spec.kv_len, device=dev).view(1, 1, 1, spec.kv_len)
    out = mask.evaluate(b, h, probe, kv, spec.q_len, spec.kv_len)
    out = out.view((1,) * (4 - out.dim()) + tuple(out.shape))
    if out.shape[2] != 1:
        raise BackendUnsupportedError(
            f"backend 'linear' cannot serve this call: mask function {mask.name!r} depends on the query position; "
            "linear attention takes only key padding masks (headlab.masks.padding(lengths), or a boolean mask of "
            "shape (batch, 1, 1, kv_len)) and causal=True; use backend='sdpa' for exact attention with this mask"
        )
    return torch.broadcast_to(out, (out.shape[0], out.shape[1], 1, spec.kv_len))[:, :, 0, :]


def from_string(text: str) -> LinearBackend:
    """A configured backend from a short string: ``"elu"``, ``"relu"``, ``"favor"``, ``"favor:256"``.

    ``"favor:M"`` has M random features (default 256); ``"favor:M:S"`` also sets the seed S.

        >>> from_string("favor:128").num_features(64), from_string("elu").feature_map
        (128, 'elu')
    """
    parts = str(text).strip().lower().split(":")
    fm = _ALIASES.get(parts[0])
    if fm is None or len(parts) > 3 or (fm != "favor" and len(parts) > 1):
        raise ConfigError(
            f"cannot read feature map {text!r}; use 'elu', 'relu', 'favor' or "
            "'favor:NUM_FEATURES[:SEED]' (e.g. favor:256)"
        )
    nums = []
    for p in parts[1:]:
        try:
            nums.append(int(p))
        except ValueError:
            raise ConfigError(f"in feature map {text!r}, {p!r} is not a whole number; "
                              "e.g. favor:256 or favor:256:0") from None
    if fm == "favor":
        return LinearBackend("favor", num_features=nums[0] if nums else None, seed=nums[1] if len(nums) > 1 else 0)
    return LinearBackend(fm)
