"""What one attention call asks for, validated once: :class:`AttentionSpec`.

Tensor convention, kept everywhere in headlab:
q ``(batch, heads, q_len, head_dim)``, k ``(batch, kv_heads, kv_len, head_dim)``,
v ``(batch, kv_heads, kv_len, v_dim)``, attention maps ``(batch, heads, q_len, kv_len)``.
Query head ``h`` reads kv head ``h // (heads // kv_heads)`` (grouped-query attention, the
layout of Hugging Face's ``repeat_kv`` and torch's ``enable_gqa``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

import headlab.checks as checks
from headlab.errors import ConfigError, DeviceError, DTypeError, MaskError, ShapeError
from headlab.spec import visibility
from headlab.spec.masks import MaskFn, as_mask
from headlab.spec.score_mods import as_score_mod

MaskKind = Literal["none", "bool", "additive", "function"]

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class AttentionSpec:
    """Shape and options of one call; what a backend's ``supports`` looks at."""

    batch: int
    heads: int  # query heads
    kv_heads: int  # key/value heads; heads % kv_heads == 0
    q_len: int
    kv_len: int
    head_dim: int  # of q and k
    v_dim: int  # of v (and of the output)
    dtype: torch.dtype
    device: torch.device
    causal: bool = False  # torch's is_causal: top-left aligned
    mask_kind: MaskKind = "none"  # "additive": a float tensor added to the scores (-inf = hidden)
    mask_shape: tuple[int, ...] | None = None  # 4-D shape of the tensor mask (as a mask function materialises)
    dropout_p: float = 0.0
    requires_grad: bool = False
    need_weights: bool = False
    need_lse: bool = False  # the caller asked for the log-sum-exp (return_lse=True)
    score_mod: bool = False  # a FlexAttention-style score_mod changes the scores

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def weights_numel(self) -> int:
        """Entries of the materialised ``(batch, heads, q_len, kv_len)`` map."""
        return self.batch * self.heads * self.q_len * self.kv_len

    def with_(self, **changes) -> AttentionSpec:
        return replace(self, **changes)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def materialized_bytes(spec: AttentionSpec, dtype: torch.dtype | None = None) -> int:
    """Bytes of one materialised attention map: batch * heads * q_len * kv_len * bytes(dtype)."""
    itemsize = torch.empty((), dtype=dtype or spec.dtype).element_size()
    return spec.weights_numel * itemsize


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(head_dim)`` by default; a non-finite scale is a ConfigError."""
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, bool):  # True was taken as a scale of 1.0
        raise ConfigError(f"scale must be a number, got {scale!r}; leave it None for 1/sqrt(head_dim)")
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise ConfigError(f"scale must be a number, got {scale!r}") from None
    if not math.isfinite(s):
        raise ConfigError(f"scale must be a finite number, got {s}; leave it None for 1/sqrt(head_dim)")
    return s


def mask_numel(spec: AttentionSpec) -> int:
    """Entries of the boolean mask a materialising backend builds (0 when there is none)."""
    if spec.mask_kind in ("bool", "additive", "function") and spec.mask_shape is not None:
        return math.prod(spec.mask_shape)
    if spec.mask_kind == "function":
        return spec.weights_numel
    if spec.causal:
        return spec.q_len * spec.kv_len
    return 0


def function_mask_shape(mask: MaskFn, batch: int, heads: int, q_len: int, kv_len: int) -> tuple[int, int, int, int]:
    """Shape of ``mask.dense(...)``: batch and head dims are 1 unless the mask depends on them."""
    return (batch if mask.batch_dependent else 1, heads if mask.head_dependent else 1, q_len, kv_len)


def _check_tensor(name: str, t, ndim: int = 4) -> None:
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ShapeError(
            f"{name} must have {ndim} dims (batch, heads, seq, head_dim), got shape {tuple(t.shape)}; "
            "reshape with .view(B, T, H, D).transpose(1, 2) from (batch, seq, embed)"
        )


def normalize_mask(mask, spec_shape: tuple[int, int, int, int]) -> torch.Tensor | MaskFn | None:
    """Turn a user mask into a 4-D tensor broadcastable to (B, H, Lq, Lk) (boolean, True = may
    attend; or floating, added to the scores as torch SDPA's float masks), or a MaskFn."""
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise MaskError(
                f"mask must be a boolean tensor (True = may attend) or an additive float tensor, got dtype "
                f"{mask.dtype}; a 0/1 Hugging Face attention_mask (1 = keep) becomes `mask = attention_mask.bool()`"
            )
        if mask.dim() > 4:
            raise MaskError(f"mask has {mask.dim()} dims {tuple(mask.shape)}; at most 4 (batch, heads, q_len, kv_len)")
        m = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
        try:  # broadcast *to* the map: a batch-3 mask for a batch of 1 failed inside the backend before
            if torch.broadcast_shapes(m.shape, spec_shape) != torch.Size(spec_shape):
                raise RuntimeError
        except RuntimeError:
            raise MaskError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to (batch, heads, q_len, kv_len) = {spec_shape}; "
                "give it shape (q_len, kv_len), (batch, 1, q_len, kv_len) or (batch, 1, 1, kv_len)"
            ) from None
        return m
    if isinstance(mask, MaskFn) or callable(mask):
        return as_mask(mask)
    raise MaskError(f"mask must be a boolean tensor or a mask function, got {type(mask).__name__}")


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask=None,
    causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    need_lse: bool = False,
    score_mod=None,
) -> tuple[AttentionSpec, torch.Tensor | MaskFn | None]:
    """Check q, k, v, the mask and the options; return the spec and the normalised mask."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in FLOATING:
            raise DTypeError(
                f"{name} has dtype {t.dtype}; attention needs a floating dtype "
                f"(float16, bfloat16, float32, float64): convert with {name}.float()"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise DTypeError(
            f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}; cast them with .to(q.dtype)"
        )
    if not (q.device == k.device == v.device):
        raise DeviceError(
            f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}; move them with .to(q.device)"
        )
    B, H, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    Bv, Hv, Lv, Dv = v.shape
    if not (B == Bk == Bv):
        raise ShapeError(f"batch sizes differ: q has {B}, k has {Bk}, v has {Bv}")
    if Dk != D:
        raise ShapeError(
            f"q and k must have the same head_dim, got q {tuple(q.shape)} (head_dim {D}) and k {tuple(k.shape)} (head_dim {Dk})"
        )
    if Hv != Hkv or Lv != Lk:
        raise ShapeError(f"k and v must agree on kv_heads and kv_len, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if Hkv == 0 or H % Hkv != 0:
        raise ShapeError(
            f"query heads must be a multiple of kv heads (grouped-query attention), got heads={H} and kv_heads={Hkv}; "
            f"choose kv_heads among the divisors of {H}"
        )
    if min(B, H, Lq, Lk, D, Dv) == 0:
        raise ShapeError(f"empty dimension in q {tuple(q.shape)}, k {tuple(k.shape)} or v {tuple(v.shape)}")
    checks.in_range("dropout_p", dropout_p, 0, 1, high_open=True)
    checks.boolean("causal", causal)  # causal="no" was read as True
    if score_mod is not None:
        as_score_mod(score_mod)  # refuses what is not callable
    norm = normalize_mask(mask, (B, H, Lq, Lk))
    if isinstance(norm, torch.Tensor) and norm.device != q.device:
        raise DeviceError(f"mask is on {norm.device} but q is on {q.device}; move it with mask.to(q.device)")
    if isinstance(norm, MaskFn):
        norm.check_sizes(B, H)
    kind: MaskKind = (
        "none"
        if norm is None
        else "function"
        if isinstance(norm, MaskFn)
        else "additive"
        if norm.is_floating_point()
        else "bool"
    )
    spec = AttentionSpec(
        batch=B,
        heads=H,
        kv_heads=Hkv,
        q_len=Lq,
        kv_len=Lk,
        head_dim=D,
        v_dim=Dv,
        dtype=q.dtype,
        device=q.device,
        causal=bool(causal),
        mask_kind=kind,
        mask_shape=tuple(norm.shape)
        if isinstance(norm, torch.Tensor)
        else (function_mask_shape(norm, B, H, Lq, Lk) if isinstance(norm, MaskFn) else None),
        dropout_p=float(dropout_p),
        requires_grad=torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
        need_weights=need_weights,
        need_lse=bool(need_lse),
        score_mod=score_mod is not None,
    )
    return spec, norm


def dense_mask(spec: AttentionSpec, mask: torch.Tensor | MaskFn | None) -> torch.Tensor | None:
    """The combined visibility (mask AND causal) as a 4-D bool tensor broadcastable to the map, or
    None (:func:`headlab.spec.visibility.visible` over every pair)."""
    return visibility.visible(spec, mask)
