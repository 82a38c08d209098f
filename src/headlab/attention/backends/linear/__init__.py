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

Feature maps (:mod:`headlab.spec.feature_maps`): ``elu`` (``elu(x) + 1``, the default:
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

import torch

from headlab.attention.backends.base import Backend, Capabilities, register
from headlab.attention.backends.linear.compute import causal_sum, exp_minus, key_mask_of, noncausal_sum
from headlab.attention.backends.linear.config import (
    DEFAULT_CHUNK,
    DEFAULT_FAVOR_FEATURES,
    FEATURE_MAP_ALIASES,
    LinearConfig,
    LinearState,
    compute_dtype,
    mix_seed,
    working_set_bytes,
)
from headlab.costs.linear import linear_cost_for
from headlab.errors import BackendUnsupportedError, ConfigError, ShapeError
from headlab.spec import feature_maps
from headlab.spec.attention_spec import AttentionSpec, default_scale, validate
from headlab.spec.memory_guard import check_fits

__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_FAVOR_FEATURES",
    "FEATURE_MAP_ALIASES",
    "LinearBackend",
    "LinearConfig",
    "LinearState",
    "from_string",
    "working_set_bytes",
]


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
    capabilities = Capabilities(
        dropout=False, returns_weights=False, exact=False, materializes=False, additive_mask=False, returns_lse=False
    )
    priority = 900
    alternative = "sdpa"
    cost = staticmethod(linear_cost_for)  # reads config and working_set_bytes of the (configured) instance

    def __init__(
        self,
        feature_map: str = "elu",
        *,
        num_features: int | None = None,
        seed: int = 0,
        chunk_size: int = DEFAULT_CHUNK,
        redraw_every: int = 0,
    ) -> None:
        self.config = LinearConfig(feature_map, num_features, seed, chunk_size, redraw_every)  # type: ignore[arg-type]  # feature_map: checked by LinearConfig
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
    def projection(
        self, head_dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        """The current FAVOR+ matrix ``W``: ``(num_features, head_dim)``. Same seed, same draw."""
        if self.config.feature_map != "favor":
            raise ConfigError(f"feature map {self.config.feature_map!r} has no random projection; use 'favor'")
        w = self._proj.get(head_dim)
        if w is None:
            gen = torch.Generator().manual_seed(mix_seed(self.config.seed, self._draw, head_dim))
            w = feature_maps.orthogonal_gaussian(self.config.features(head_dim), head_dim, gen)  # favor: num_features
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
            raise ConfigError(
                f"redraw() applies to FAVOR+ random features; feature map {self.config.feature_map!r} is deterministic"
            )
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

    def working_set_bytes(self, spec: AttentionSpec) -> int:
        fm = self.config.num_features if self.config.feature_map == "favor" else None
        return working_set_bytes(spec, fm, self.config.chunk_size)

    def check_memory(self, spec: AttentionSpec) -> None:
        check_fits(
            self.working_set_bytes(spec),
            what=f"backend 'linear' at {spec.q_len}x{spec.kv_len}",
            device=spec.device,
            alternative=None,
        )

    def forward(self, q, k, v, spec, *, mask, scale, score_mod=None):
        self._maybe_redraw()
        key_mask = key_mask_of(spec, mask)  # (Bm, Hm, Lk) or None
        cdt = compute_dtype(q.dtype)
        q_, k_, v_ = q.to(cdt), k.to(cdt), v.to(cdt)
        group = spec.group
        if key_mask is not None and key_mask.shape[1] > 1 and group > 1:
            # a mask per query head: query heads of a group see different keys; give each its own copy
            k_ = k_.repeat_interleave(group, dim=1)  # (B, H, Lk, D)
            v_ = v_.repeat_interleave(group, dim=1)  # (B, H, Lk, Dv)
            group = 1
        fq, fk = self._features(q_, k_, scale, key_mask)  # (B, H, Lq, F), (B, Hk, Lk, F)
        if spec.causal:
            out = causal_sum(fq, fk, v_, group, self.config.chunk_size)
        else:
            out = noncausal_sum(fq, fk, v_, group)
        return out.to(q.dtype), None, None

    def _features(
        self, q: torch.Tensor, k: torch.Tensor, scale: float, key_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        s = scale**0.5  # exp(q.k * scale) = exp((q s).(k s))
        # queries: exp(W q - |q|^2/2) / sqrt(m) and exp(W q - max_l (W q)_l) differ by a factor per row
        lq = torch.matmul(q, w.T * s)  # (B, H, Lq, m)
        fq = exp_minus(lq, lq.detach().amax(-1, keepdim=True))
        # keys: exp(W k - |k|^2/2 - shift) with one shift per (batch, kv head) over all keys
        lk = torch.matmul(k, w.T * s)  # (B, Hk, Lk, m)
        half_sq = (0.5 * scale) * (k * k).sum(-1, keepdim=True)  # (B, Hk, Lk, 1)
        top = lk.detach().amax(-1, keepdim=True) - half_sq.detach()  # (B, Hk, Lk, 1): each key's largest exponent
        if km is not None:
            top = top.masked_fill(~km, float("-inf"))
        shift = top.amax(dim=-2, keepdim=True)  # (B, Hk, 1, 1)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        fk = exp_minus(lk, half_sq + shift, hide=None if km is None else ~km)  # hidden keys: exp(-inf) = 0
        return fq, fk

    # -- diagnostics and decoding ----------------------------------------------------------
    def implied_weights(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        rows=None,
        *,
        mask=None,
        causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
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
        key_mask = key_mask_of(spec, norm)
        cdt = compute_dtype(q.dtype)
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

    def step(
        self,
        q_t: torch.Tensor,
        k_t: torch.Tensor,
        v_t: torch.Tensor,
        state: LinearState | None = None,
        *,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, LinearState]:
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
                raise ShapeError(
                    f"step takes one token: got q_t {tuple(q_t.shape)}, k_t {tuple(k_t.shape)}, "
                    f"v_t {tuple(v_t.shape)}; slice with x[:, :, t]"
                )
            q_t, k_t, v_t = q_t[:, :, 0], k_t[:, :, 0], v_t[:, :, 0]
        if q_t.dim() != 3 or k_t.dim() != 3 or v_t.dim() != 3:
            raise ShapeError(
                f"step expects q_t (B, H, D), k_t (B, Hkv, D), v_t (B, Hkv, Dv); got "
                f"{tuple(q_t.shape)}, {tuple(k_t.shape)}, {tuple(v_t.shape)}"
            )
        B, H, D = q_t.shape
        Hk = k_t.shape[1]
        if k_t.shape[0] != B or v_t.shape[:2] != k_t.shape[:2] or k_t.shape[2] != D or Hk == 0 or H % Hk:
            raise ShapeError(
                f"step: q_t {tuple(q_t.shape)}, k_t {tuple(k_t.shape)}, v_t {tuple(v_t.shape)} do not "
                "fit: batch must agree, k_t must have q_t's head_dim, heads a multiple of kv heads"
            )
        G = H // Hk
        scale = default_scale(D) if scale is None else float(scale)
        cdt = compute_dtype(q_t.dtype)
        q_, k_, v_ = q_t.to(cdt), k_t.to(cdt), v_t.to(cdt)
        if self.config.feature_map == "favor":
            w = self.projection(D, q_t.device, cdt)
            root, s = math.sqrt(w.shape[0]), scale**0.5
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


def from_string(text: str) -> LinearBackend:
    """A configured backend from a short string: ``"elu"``, ``"relu"``, ``"favor"``, ``"favor:256"``.

    ``"favor:M"`` has M random features (default 256); ``"favor:M:S"`` also sets the seed S.

        >>> from_string("favor:128").num_features(64), from_string("elu").feature_map
        (128, 'elu')
    """
    parts = str(text).strip().lower().split(":")
    fm = FEATURE_MAP_ALIASES.get(parts[0])
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
            raise ConfigError(
                f"in feature map {text!r}, {p!r} is not a whole number; e.g. favor:256 or favor:256:0"
            ) from None
    if fm == "favor":
        return LinearBackend("favor", num_features=nums[0] if nums else None, seed=nums[1] if len(nums) > 1 else 0)
    return LinearBackend(fm)
