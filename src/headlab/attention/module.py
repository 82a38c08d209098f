"""``MultiHeadAttention``: the module, from the equations (Vaswani et al. 2017).

    head_h = softmax(Q W_Q^h (K W_K^h)^T / sqrt(d_k) + M) V W_V^h
    MHA(Q, K, V) = Concat(head_1, ..., head_H) W^O

Weights live in four ``nn.Linear`` layers laid out like Hugging Face's (``q_proj``, ``k_proj``,
``v_proj``, ``out_proj``); the per-head matrices of the equations are views into them
(:attr:`MultiHeadAttention.W_Q` ...), so editing a view edits the layer.
"""

from __future__ import annotations

import torch
from torch import nn

import headlab.checks as checks
from headlab.attention import backends as _backends
from headlab.attention.core import attention_with_weights
from headlab.errors import BackendUnsupportedError, ConfigError, DeviceError, DTypeError, MaskError, ShapeError
from headlab.spec.masks import MaskFn, as_mask


class MultiHeadAttention(nn.Module):
    """Multi-head attention, batch first: inputs ``(batch, seq, embed)``.

    Args:
        embed_dim: model width E; ``head_dim = embed_dim // num_heads``.
        num_heads: query heads H.
        num_kv_heads: key/value heads (grouped-query attention; 1 = multi-query); default H.
        kdim, vdim: widths of the key and value inputs for cross-attention; default E.
        bias: biases on the four projections.
        dropout: dropout on attention probabilities while training.
        backend: attention backend (``"auto"``, ``"sdpa"``, ``"reference"``, ...).

    ``head_gate`` (shape ``(H,)``, default ones) multiplies each head's output before W^O;
    set an entry to 0 to ablate a head, or call ``head_gate.requires_grad_(True)`` to take
    gradients with respect to the gates (head importance).

    Example:
        >>> import torch, headlab
        >>> mha = headlab.MultiHeadAttention(32, 4, num_kv_heads=2)
        >>> x = torch.randn(2, 7, 32)
        >>> out, w = mha(x, causal=True, need_weights=True)
        >>> out.shape, w.shape
        (torch.Size([2, 7, 32]), torch.Size([2, 4, 7, 7]))
        >>> mha.W_Q.shape, mha.W_O.shape     # (H, E, d), (H, d, E)
        (torch.Size([4, 32, 8]), torch.Size([4, 8, 32]))
    """

    head_gate: torch.Tensor  # a buffer (H,): one gate per head (a view of the adapter's gates once adapted)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            checks.integer(name, val)  # 16.0 would fail inside torch
        for name, dim in (("kdim", kdim), ("vdim", vdim)):
            if dim is not None:  # 0 would read as "not given" below, a negative fail inside nn.Linear
                checks.positive_int(name, dim)
        if not (isinstance(backend, str) and backend == "auto"):
            _backends.get(backend)  # UnknownBackendError listing the known ones now, not at the first call
        checks.number("dropout", dropout)
        if embed_dim <= 0 or num_heads <= 0 or num_kv_heads <= 0:
            raise ConfigError(
                f"embed_dim, num_heads and num_kv_heads must be positive, got {embed_dim}, {num_heads}, {num_kv_heads}"
            )
        if embed_dim % num_heads:
            raise ConfigError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {dropout}")
        fk = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = kdim or embed_dim
        self.vdim = vdim or embed_dim
        self.dropout = dropout
        self.backend = backend
        d = self.head_dim
        self.q_proj = nn.Linear(embed_dim, num_heads * d, bias=bias, **fk)
        self.k_proj = nn.Linear(self.kdim, num_kv_heads * d, bias=bias, **fk)
        self.v_proj = nn.Linear(self.vdim, num_kv_heads * d, bias=bias, **fk)
        self.out_proj = nn.Linear(num_heads * d, embed_dim, bias=bias, **fk)
        self.register_buffer("head_gate", torch.ones(num_heads, **fk), persistent=False)

    # -- per-head views of the equations' matrices ---------------------------------------------
    @property
    def W_Q(self) -> torch.Tensor:
        """``(H, E, d)``: ``x @ W_Q[h]`` is head h's query."""
        return self.q_proj.weight.view(self.num_heads, self.head_dim, self.embed_dim).transpose(1, 2)

    @property
    def W_K(self) -> torch.Tensor:
        """``(H_kv, kdim, d)``."""
        return self.k_proj.weight.view(self.num_kv_heads, self.head_dim, self.kdim).transpose(1, 2)

    @property
    def W_V(self) -> torch.Tensor:
        """``(H_kv, vdim, d)``."""
        return self.v_proj.weight.view(self.num_kv_heads, self.head_dim, self.vdim).transpose(1, 2)

    @property
    def W_O(self) -> torch.Tensor:
        """``(H, d, E)``: row block h of W^O, head h's share of the output projection."""
        return self.out_proj.weight.t().view(self.num_heads, self.head_dim, self.embed_dim)

    def head_weights(self, h: int) -> dict[str, torch.Tensor]:
        """Head ``h``'s W_Q, W_K, W_V (of its kv head) and W_O blocks."""
        if not 0 <= h < self.num_heads:
            raise ConfigError(f"head index {h} out of range: the module has {self.num_heads} heads")
        g = h // (self.num_heads // self.num_kv_heads)
        return {"W_Q": self.W_Q[h], "W_K": self.W_K[g], "W_V": self.W_V[g], "W_O": self.W_O[h]}

    # -- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        mask=None,
        attn_mask: torch.Tensor | None = None,
        causal: bool = False,
        need_weights: bool = False,
        backend: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when they are omitted).

        Args:
            query: ``(B, Lq, E)``; key ``(B, Lk, kdim)``; value ``(B, Lk, vdim)``.
            key_padding_mask: ``(B, Lk)`` bool, **True = padding** (ignored key), as in
                ``torch.nn.MultiheadAttention``.
            mask: boolean ``(Lq, Lk)`` / ``(B, H, Lq, Lk)``, **True = may attend** (as in
                ``headlab.attention`` and SDPA), an additive float mask, or a mask function.
            attn_mask: ``torch.nn.MultiheadAttention``'s keyword with torch's meaning, so that ported
                code is right: boolean **True = NOT allowed to attend**, or a float mask added to the
                scores; ``(Lq, Lk)`` or ``(B * H, Lq, Lk)``. Give ``mask`` or ``attn_mask``, not both.
            causal: query i sees keys 0..i.
            need_weights: also return per-head weights ``(B, H, Lq, Lk)``. Only the ``reference``
                backend materialises them: with ``backend`` left to ``"auto"`` (here or on the module)
                the call runs on ``reference``; an explicit backend that cannot return weights is
                refused with :class:`~headlab.errors.BackendUnsupportedError` (never replaced silently).
            backend: this call's backend; ``None`` = the module's ``backend``.

        Returns:
            ``(out (B, Lq, E), weights or None)``.
        """
        key = query if key is None else key
        value = key if value is None else value
        widths = (
            ("query", query, self.embed_dim, "embed_dim"),
            ("key", key, self.kdim, "kdim"),
            ("value", value, self.vdim, "vdim"),
        )
        for name, t, width, arg in widths:
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ShapeError(
                    f"{name} must be (batch, seq, features), got "
                    f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                )
            if t.shape[-1] != width:
                raise ShapeError(
                    f"{name} has {t.shape[-1]} features in its last dimension (shape {tuple(t.shape)}) "
                    f"but the module expects {arg}={width}; the input must be (batch, seq, {width})"
                )
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ShapeError(
                f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} must "
                "share the batch size, and key and value the sequence length"
            )
        self._check_dtypes(query, key, value)
        B, Lq, _ = query.shape
        Lk = key.shape[1]
        H, Hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(query).view(B, Lq, H, d).transpose(1, 2)  # (B, H, Lq, d)
        k = self.k_proj(key).view(B, Lk, Hkv, d).transpose(1, 2)  # (B, Hkv, Lk, d)
        v = self.v_proj(value).view(B, Lk, Hkv, d).transpose(1, 2)  # (B, Hkv, Lk, d)
        if attn_mask is not None:
            if mask is not None:
                raise MaskError(
                    "give either mask= (headlab's: True = may attend) or attn_mask= (torch's: True = "
                    "masked out), not both"
                )
            mask = _from_torch_attn_mask(attn_mask, B, H, Lq, Lk)
        full_mask = _combine_masks(mask, key_padding_mask, B, Lk)
        chosen = self.backend if backend is None else backend
        if need_weights:
            chosen = _weights_backend(chosen)
        z, weights = attention_with_weights(
            q,
            k,
            v,
            mask=full_mask,
            causal=causal,
            scale=None,
            dropout_p=self.dropout if self.training else 0.0,
            backend=chosen,
            need_weights=need_weights,
        )  # z: (B, H, Lq, d)
        if tuple(self.head_gate.shape) != (H,):
            raise ShapeError(
                f"head_gate has shape {tuple(self.head_gate.shape)} but the module has {H} heads; "
                f"give one gate per head, e.g. torch.ones({H}) with 0 for each head to silence"
            )
        z = z * self.head_gate.view(1, H, 1, 1).to(z.dtype)
        out = self.out_proj(z.transpose(1, 2).reshape(B, Lq, H * d))  # (B, Lq, E)
        return out, weights

    def _check_dtypes(self, *inputs: torch.Tensor) -> None:
        """The inputs are on the weights' device, floating and, outside autocast, of the weights' dtype (torch's
        own message, "mat1 and mat2 must have the same dtype", names neither the module nor the cure)."""
        w, dev = self.q_proj.weight.dtype, self.q_proj.weight.device
        for name, t in zip(("query", "key", "value"), inputs):
            if t.device != dev:
                raise DeviceError(
                    f"{name} is on {t.device} but the module's weights are on {dev}; move one to the "
                    f"other: {name}.to({str(dev)!r}) or module.to({str(t.device)!r})"
                )
            if not t.is_floating_point():
                raise DTypeError(
                    f"{name} is {t.dtype}, but attention needs floating-point inputs; cast it, e.g. {name}.to({w})"
                )
            if t.dtype != w and not torch.is_autocast_enabled(t.device.type):
                raise DTypeError(
                    f"{name} is {t.dtype} but the module's weights are {w}; cast the module "
                    f"(module.to({t.dtype})) or the input ({name}.to({w})), or run under "
                    "torch.autocast"
                )

    # -- interop ---------------------------------------------------------------------------------
    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention, *, backend: str = "auto") -> MultiHeadAttention:
        """Copy a ``torch.nn.MultiheadAttention`` (batch_first or not; the copy is batch first).

        ``add_bias_kv`` and ``add_zero_attn`` have no counterpart in the equations and are refused.
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise ConfigError(f"from_torch expects torch.nn.MultiheadAttention, got {type(m).__name__}")
        if m.bias_k is not None or m.add_zero_attn:
            raise ConfigError(
                "from_torch: add_bias_kv / add_zero_attn are not supported; build the module without them"
            )
        E = m.embed_dim
        has_bias = m.in_proj_bias is not None
        w = m.in_proj_weight if m._qkv_same_embed_dim else None
        p = next(m.parameters())
        new = cls(
            E,
            m.num_heads,
            kdim=m.kdim,
            vdim=m.vdim,
            bias=has_bias,
            dropout=m.dropout,
            backend=backend,
            device=p.device,
            dtype=p.dtype,
        )
        with torch.no_grad():
            if w is not None:
                new.q_proj.weight.copy_(w[:E])
                new.k_proj.weight.copy_(w[E : 2 * E])
                new.v_proj.weight.copy_(w[2 * E :])
            else:
                new.q_proj.weight.copy_(m.q_proj_weight)
                new.k_proj.weight.copy_(m.k_proj_weight)
                new.v_proj.weight.copy_(m.v_proj_weight)
            if has_bias:
                new.q_proj.bias.copy_(m.in_proj_bias[:E])
                new.k_proj.bias.copy_(m.in_proj_bias[E : 2 * E])
                new.v_proj.bias.copy_(m.in_proj_bias[2 * E :])
            new.out_proj.weight.copy_(m.out_proj.weight)
            if m.out_proj.bias is not None and new.out_proj.bias is not None:
                new.out_proj.bias.copy_(m.out_proj.bias)
        return new

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, backend={self.backend!r}"
        )


def _weights_backend(backend):
    """The backend of a call that returns weights: ``auto`` means ``reference``; an explicit backend
    must be able to return them (it is refused, not replaced)."""
    if isinstance(backend, str) and backend == "auto":
        return "reference"
    b = _backends.get(backend)
    if not b.capabilities.returns_weights:
        raise BackendUnsupportedError(
            f"need_weights=True needs a backend that materialises the weights, but backend {b.name!r} does not; "
            "use backend='reference' (or 'auto') for this call, or need_weights=False"
        )
    return b


def _from_torch_attn_mask(attn_mask: torch.Tensor, batch: int, heads: int, q_len: int, kv_len: int):
    """torch.nn.MultiheadAttention's ``attn_mask`` (bool True = masked out, or additive float;
    ``(Lq, Lk)`` or ``(B * H, Lq, Lk)``) as headlab's mask (bool True = may attend, or additive)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise MaskError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
    if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (q_len, kv_len):
        m = attn_mask
    elif attn_mask.dim() == 3 and tuple(attn_mask.shape) == (batch * heads, q_len, kv_len):
        m = attn_mask.view(batch, heads, q_len, kv_len)
    else:
        raise MaskError(
            f"attn_mask must have torch's shape (L, S) = {(q_len, kv_len)} or (N * num_heads, L, S) = "
            f"{(batch * heads, q_len, kv_len)}, got {tuple(attn_mask.shape)}"
        )
    if m.dtype == torch.bool:
        return ~m
    if m.is_floating_point():
        return m
    raise MaskError(f"attn_mask must be bool (True = masked out, torch's meaning) or float (added), got {m.dtype}")


def _combine_masks(mask, key_padding_mask, batch: int, kv_len: int):
    if key_padding_mask is None:
        return mask
    if key_padding_mask.dtype != torch.bool:
        raise MaskError(
            f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}; "
            "convert a 0/1 attention mask with `key_padding_mask = attention_mask == 0`"
        )
    if tuple(key_padding_mask.shape) != (batch, kv_len):
        raise MaskError(
            f"key_padding_mask must have shape (batch, kv_len) = {(batch, kv_len)}, got {tuple(key_padding_mask.shape)}"
        )
    keep = ~key_padding_mask.view(batch, 1, 1, kv_len)  # True = may attend
    if mask is None:
        return keep
    if isinstance(mask, torch.Tensor):
        m4 = mask if mask.dim() == 4 else mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if mask.is_floating_point():  # additive: padding keys get -inf
            return m4.masked_fill(~keep, float("-inf"))
        if mask.dtype != torch.bool:
            raise MaskError(f"mask must be bool (True = may attend) or an additive float mask, got {mask.dtype}")
        return keep & m4
    kpm = key_padding_mask

    def fn(b, h, q, kv, lq, lk):
        return ~kpm.to(kv.device)[b, kv]

    return as_mask(mask) & MaskFn(fn, "key_padding", batch_dependent=True, batch_size=batch)
