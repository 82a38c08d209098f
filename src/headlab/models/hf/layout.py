"""What one stack's blocks look like, read from a recorded forward: projections, W^O, norm layout, head counts.

:func:`stack_layout` is called by :func:`headlab.models.hf.structure.discover` once per stack (the single
stack of a decoder or encoder; an encoder-decoder's encoder, decoder and cross-attention) on the first block.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import nn

import headlab.checks as checks
from headlab.models.hf.family import Norms
from headlab.models.hf.trace import (
    Call,
    close,
    continues_from,
    in_features,
    is_conv1d,
    is_linear,
    is_norm,
    mark_norms,
    out_features,
    recording,
    refuse,
    trace,
)
from headlab.models.projections import Fused, Out, Separate


@dataclass
class Layout:
    """What structure showed about one stack's blocks (paths relative to a block)."""

    attention: str
    projections: Separate | Fused
    out: Out
    norms: Norms | None  # None: the residual layout was not identified (``norms_why`` says why)
    norms_why: str = ""
    notes: list[str] = field(default_factory=list)
    value_norm: str | None = None  # a norm the values pass through after W_V (a path from the attention module)


@dataclass
class _StackLayout:
    layout: Layout
    out_module: nn.Module


def stack_layout(model, x, block: nn.Module, attn_path: str, call: Call, H, Hkv, d, mt, stack) -> _StackLayout:
    """Projections, W^O and the norm layout of one stack, from its first block run on ``x``."""
    named = dict(block.named_modules())
    with recording({n: m for n, m in named.items()}) as rec:
        trace(model, x)
    if not rec:
        raise refuse(mt, f"the {stack} block did not run")
    # W_V: the projection whose output is the v the call received
    B, _, Lk, _ = call.v.shape
    v_flat = call.v.transpose(1, 2).reshape(B, Lk, Hkv * d)
    attn_prefix = f"{attn_path}." if attn_path else ""
    lin = {
        n[len(attn_prefix) :]: m for n, m in named.items() if n.startswith(attn_prefix) and is_linear(m) and n in rec
    }
    rec_rel = {n[len(attn_prefix) :]: rec[n] for n in rec if n.startswith(attn_prefix)}
    projections: Separate | Fused | None = None
    for n, m in lin.items():
        out = rec_rel[n][1]
        if out is None:
            continue
        f = out_features(m)
        if f == Hkv * d and close(out, v_flat):
            projections = _separate(n, lin, rec_rel, H, Hkv, d, call, mt)
            break
        if f == (H + 2 * Hkv) * d:
            for order in ("blocks", "per_head", "grouped"):
                if order == "per_head" and H != Hkv:
                    continue
                fused = Fused(n, order, conv1d=is_conv1d(m))
                rows = fused._rows("v", range(Hkv), H, Hkv, d)
                if close(out[..., rows], v_flat):
                    projections = fused
                    break
            if projections is not None:
                break
    vnorm = (
        None
        if projections is not None
        else next(
            (
                n
                for n, (_, o) in rec_rel.items()
                if n
                and is_norm(named[attn_prefix + n])
                and o is not None
                and o.numel() == v_flat.numel()
                and (close(o.reshape(v_flat.shape), v_flat) or close(o.reshape(call.v.shape), call.v))
            ),
            None,
        )
    )
    value_norm = None
    if vnorm is not None:
        projections = _normed_values(vnorm, named[attn_prefix + vnorm], lin, rec_rel, H, Hkv, d, call, mt)
        value_norm = vnorm
    if projections is None:
        raise refuse(
            mt,
            f"no linear map in its {stack} attention module computes the values the attention reads "
            f"({Hkv} x {d} features); a transform between the projection and the call (a value norm?) "
            "needs a family class",
        )
    # W^O: the linear map whose input is the attention output merged to (B, L, H*d)
    Bq, _, Lq, _ = call.out.shape
    merged = call.out.transpose(1, 2).reshape(Bq, Lq, H * d)
    out_name = next(
        (
            n
            for n, m in named.items()
            if is_linear(m) and n in rec and in_features(m) == H * d and close(rec[n][0], merged)
        ),
        None,
    )
    if out_name is None:
        raise refuse(mt, _behind_transform(named, rec, merged, H, d, stack))
    out_mod = named[out_name]
    notes: list[str] = []
    norms, why = _norms(block, named, rec, attn_path, out_name, stack)
    return _StackLayout(
        Layout(
            attention=attn_path,
            projections=projections,
            out=Out(out_name, conv1d=is_conv1d(out_mod)),
            norms=norms,
            norms_why=why,
            notes=notes,
            value_norm=value_norm,
        ),
        out_mod,
    )


def _normed_values(vnorm: str, norm: nn.Module, lin, rec, H, Hkv, d, call: Call, mt) -> Separate:
    """The projections of values that pass through the value norm ``vnorm`` (Gemma 3n's and Gemma 4's ``v_norm``):
    W_V is the linear map whose output is the norm's input; the norm must act on each head's ``d`` features alone
    (what it reads has ``d`` on its last axis), so the values stay per head (pruning, gates and captures serve)."""
    n_in = rec[vnorm][0]
    if n_in is None or n_in.shape[-1] != d:
        raise refuse(
            mt,
            f"its values pass through the value norm {vnorm!r} ({type(norm).__name__}) over "
            f"{None if n_in is None else n_in.shape[-1]} features, not each head's {d}: it mixes "
            "heads, so no head's values are its own; a family class must declare how",
        )

    def feeds(o):  # (B, L, Hkv * d) -> the norm's input, per head, before or after the heads' transpose
        if o is None or o.numel() != n_in.numel() or o.dim() != 3:
            return False
        per_head = o.reshape(o.shape[0], o.shape[1], Hkv, d)
        return close(per_head, n_in) or close(per_head.transpose(1, 2), n_in)

    v_name = next((n for n, m in lin.items() if out_features(m) == Hkv * d and feeds(rec[n][1])), None)
    if v_name is None:
        raise refuse(mt, f"no linear map in its attention module makes the input of its value norm {vnorm!r}")
    return _separate(v_name, lin, rec, H, Hkv, d, call, mt)


def _behind_transform(named, rec, merged, H, d, stack) -> str:
    """Why no linear map reads the attention output as it is, naming the transform between them where it shows: a
    sub-norm (a norm reading the merged output), or an elementwise gate (W^O reads it multiplied by something)."""
    sub = next((n for n, m in named.items() if is_norm(m) and n in rec and close(rec[n][0], merged)), None)
    head = f"no linear map in its {stack} block reads the attention output ({H} x {d} features) as it is"
    if sub is not None:
        return (
            f"{head}: the sub-norm {sub!r} ({type(named[sub]).__name__}) normalises it before the output "
            "projection, which W^O per head cannot express; a family class must declare the sub-norm"
        )

    def gate_of(t):  # t = merged * g with 0 <= g <= 1 elementwise (a sigmoid gate)?
        if t is None or t.numel() != merged.numel():
            return False
        r = t.double().reshape(merged.shape) / merged.double().where(merged != 0, torch.ones_like(merged).double())
        return bool(((r >= -1e-6) & (r <= 1 + 1e-6)).all()) and not close(t, merged)

    gated = next(
        (n for n, m in named.items() if is_linear(m) and n in rec and in_features(m) == H * d and gate_of(rec[n][0])),
        None,
    )
    if gated is not None:
        return (
            f"{head}: {gated!r} reads it multiplied elementwise by a gate in [0, 1] (gated attention, as Qwen3-Next's), so "
            "its heads' contributions are not z_h W_O[h]; a family class must declare the gate"
        )
    return f"{head}: an output projection behind another transform needs a family class"


def _separate(v_name, lin, rec, H, Hkv, d, call: Call, mt) -> Separate:
    """q and k beside W_V: by count, then by name, then by value (a projection whose output is the q or k the
    call received, when no rotation or norm comes between)."""
    B, _, Lq, _ = call.q.shape
    q_flat = call.q.transpose(1, 2).reshape(B, Lq, H * d)
    k_flat = call.k.transpose(1, 2).reshape(call.k.shape[0], call.k.shape[2], Hkv * d)
    conv = is_conv1d(lin[v_name])

    def pick(letter, width, target, exclude):
        cands = [
            n
            for n, m in lin.items()
            if n not in exclude and out_features(m) == width and in_features(m) == in_features(lin[v_name])
        ]
        exact = [n for n in cands if close(rec[n][1], target)]
        if len(exact) == 1:
            return exact[0]
        by_name = [n for n in cands if _named(letter, n)]
        if len(by_name) == 1:
            return by_name[0]
        if len(cands) == 1:
            return cands[0]
        raise refuse(
            mt,
            f"cannot tell its {'query' if letter == 'q' else 'key'} projection among {cands or 'none'} "
            f"(beside the value projection {v_name!r})",
        )

    q = pick("q", H * d, q_flat, {v_name})
    k = pick("k", Hkv * d, k_flat, {v_name, q})
    return Separate(q, k, v_name, conv1d=conv)


def _named(letter: str, name: str) -> bool:
    """Is projection ``name`` (its last path component) named for ``letter`` (``q``, ``k``)?"""
    last = name.split(".")[-1].lower()
    word = {"q": "query", "k": "key"}[letter]
    return (
        last in (letter, word, f"w{letter}")
        or last.startswith((f"{letter}_", word))
        or last.endswith((f"_{letter}", f"{letter}_proj", f"{letter}_lin"))
    )


def _norm_kind(m: nn.Module, z: torch.Tensor, y: torch.Tensor) -> tuple[Literal["layernorm", "rmsnorm"], float] | None:
    """``(kind, offset)`` of a norm from one input/output pair: LayerNorm or RMSNorm, weight ``w`` or ``1 + w``."""
    z = z.double()
    eps = float(next((getattr(m, n) for n in ("eps", "variance_epsilon", "epsilon") if hasattr(m, n)), 1e-5))
    w = getattr(m, "weight", None)
    b = getattr(m, "bias", None)
    for kind in ("layernorm", "rmsnorm"):
        u = z - z.mean(-1, keepdim=True) if kind == "layernorm" else z
        base = u / torch.sqrt((u * u).mean(-1, keepdim=True) + eps)
        for offset in (0.0, 1.0):
            pred = base * ((w.detach().double() if w is not None else 1.0) + offset)
            if b is not None:
                pred = pred + b.detach().double()
            if close(pred, y, 1e-4):
                return kind, offset
            if w is None:
                break
    return None


_NO_ADD = "no norm or residual add after the attention reads x + Attn(x) or a norm of it"


def _norms(block, named, rec, attn_path, out_name, stack) -> tuple[Norms | None, str]:
    """The norm layout around the attention of one block (see :mod:`headlab.models.norm_layout`), with the
    attention's output as W^O writes it or, where no layout reads that, scaled as the block scales its branch
    (:func:`_branch_scales`: LayerScale, a residual multiplier)."""
    o = rec[out_name][1]
    norms, why = _layout(block, named, rec, attn_path, out_name, stack, o)
    if norms is not None or not why.startswith(_NO_ADD):
        return norms, why
    for path, scaled in _branch_scales(block, named, rec, attn_path, out_name, o):
        got, _ = _layout(block, named, rec, attn_path, out_name, stack, scaled)
        if got is not None:
            return replace(got, branch_scale=path), ""
    return None, why


def _branch_scales(block, named, rec, attn_path, out_name, o):
    """``(path, scaled output)`` of each way the block may scale the attention's output before reading it: a
    module reading it that multiplies it by its own ``(E,)`` vector (DINOv2's LayerScale), an ``(E,)`` parameter
    of the block itself (BEiT's ``lambda_1``), a number the block holds (Granite's ``residual_multiplier``)."""
    E = o.shape[-1]
    for n, m in named.items():
        if not n or n == out_name or n == attn_path or n.startswith(f"{attn_path}.") or n not in rec:
            continue
        i, y = rec[n]
        if i is None or y is None or not close(i, o):
            continue
        for pn, prm in m.named_parameters(recurse=False):
            if prm.dim() == 1 and prm.numel() == E and close(o * prm.detach(), y):
                yield f"{n}.{pn}", y
    for pn, prm in block.named_parameters(recurse=False):
        if prm.dim() == 1 and prm.numel() == E:
            yield pn, o * prm.detach()
    for an, v in vars(block).items():
        if isinstance(v, float) and not an.startswith("_") and v not in (0.0, 1.0):
            yield an, o * v


def _layout(block, named, rec, attn_path, out_name, stack, o) -> tuple[Norms | None, str]:
    """The layout for the attention branch ``o``: sandwich when a norm reads the branch alone; otherwise the
    stream after the attention is ``x + o`` (pre, parallel) or a norm of it (post), whichever the next residual
    add continues from."""
    x = rec.get("", (None, None))[0]  # the block's input stream
    attn_in = rec.get(attn_path, (None, None))[0]
    if x is None or attn_in is None or o is None:
        return None, "the block's input or its attention's input was not seen"
    if stack == "cross":
        return None, "cross-attention has no residual decomposition over its keys"
    in_attn = lambda n: n == attn_path or n.startswith(f"{attn_path}.") or n == out_name
    norms = {
        n: m
        for n, m in named.items()
        if n and is_norm(m) and n in rec and not in_attn(n) and rec[n][0] is not None and rec[n][1] is not None
    }
    if close(attn_in, x):
        pre = None
    else:
        pre = next((n for n in norms if close(rec[n][1], attn_in)), None)
        if pre is None:
            return None, "the attention reads neither the block's input nor a norm of it"
    if o.shape != x.shape:
        return None, f"the attention writes {tuple(o.shape)} into a stream of {tuple(x.shape)}"
    h = x + o
    branch = next((n for n in norms if n != pre and close(rec[n][0], o)), None)
    if branch is not None:
        kind = _norm_kind(named[branch], rec[branch][0], rec[branch][1])
        if kind is None:
            return None, f"its post norm {branch!r} is neither a LayerNorm nor an RMSNorm"
        return Norms(pre=pre, post=branch, post_reads="branch", kind=kind[0], offset=kind[1]), ""
    marked = mark_norms({n: v for n, v in rec.items() if not in_attn(n) or n == out_name}, norms)
    reads_sum = next((n for n in norms if n != pre and close(rec[n][0], h)), None)
    if (
        reads_sum is not None
        and pre is None
        and continues_from(rec[reads_sum][1], marked, skip=lambda n: n == out_name)
    ):
        kind = _norm_kind(named[reads_sum], rec[reads_sum][0], rec[reads_sum][1])
        if kind is None:
            return None, f"its post norm {reads_sum!r} is neither a LayerNorm nor an RMSNorm"
        return Norms(pre=pre, post=reads_sum, post_reads="sum", kind=kind[0], offset=kind[1]), ""
    if reads_sum is not None and continues_from(h, marked, skip=lambda n: n == out_name):
        return Norms(pre=pre, kind="layernorm"), ""  # the next sublayer's pre norm reads x + Attn(x)
    block_out = rec.get("", (None, None))[1]
    adders = [
        n
        for n, (_, out) in rec.items()
        if n
        and out is not None
        and n not in norms
        and not in_attn(n)
        and block_out is not None
        and out.numel() == h.numel()
        and close(block_out, h + out.reshape(h.shape))
    ]
    if adders and reads_sum is None:
        return Norms(pre=pre, kind="layernorm", parallel=min(adders, key=lambda n: n.count("."))), ""
    if continues_from(h, marked, skip=lambda n: n == out_name):
        return Norms(pre=pre, kind="layernorm"), ""
    return None, (
        f"{_NO_ADD}, nor the attention's output scaled by a LayerScale vector or a number the block holds; a "
        "family class can declare the scale (Norms(branch_scale=...))"
    )


def head_attrs(attn: nn.Module, H: int, Hkv: int, d: int) -> dict[str, str]:
    """The attention module's integer attributes that count heads (what pruning must update)."""
    G = H // Hkv
    found: dict[str, str] = {}
    for name, v in vars(attn).items():
        if not checks.is_int(v) or name.startswith("_"):
            continue
        low = name.lower()
        if low in ("head_dim", "head_size", "attention_head_size", "rotary_ndims", "rotary_dim"):
            continue
        if "group" in low and v == G:
            found[name] = "G"
        elif ("kv" in low or "key_value" in low) and "head" in low and v == Hkv:
            found[name] = "Hkv"
        elif "head" in low and ("size" in low or "dim" in low) and v == H * d:
            found[name] = "H*d"
        elif "head" in low and v == H:
            found[name] = "H"
        elif low in ("inner_dim", "split_size", "all_head_size", "embed_dim") and v == H * d:
            found[name] = "H*d"
    return found


__all__ = ["Layout", "head_attrs", "stack_layout"]
