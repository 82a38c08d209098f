"""The ablation engine: many ablation configurations of one batch in one forward.

A configuration is a boolean ``(n_layers, H)`` mask of the heads it ablates. ``C`` configurations
of a batch of ``B`` examples run as one forward of ``C * B`` rows (the batch repeated), and a
pre-hook on every W^O replaces, in the rows of configuration c, the per-head output z_h of each
head c ablates. Replacements (``kind``):

==========  ================================================================================
zero        z_h = 0 (the same as gate 0)
mean        z_h = the mean of z_h over the reference set: over every real token (``"token"``) or
            per position (``"position"``; positions no reference text reaches use the token mean)
resample    z_h = z_h of another example of the set, from the unablated run: example b takes the
            next example of its batch (cyclically), position by position; where the donor is
            shorter, its last real position
uniform     the head's attention pattern replaced by uniform weights over the keys it may see
            (real tokens, and only the past for decoders): z_h(i) = mean_{j visible} v_kv(h)(j),
            from the values of this very forward (so earlier ablations propagate)
==========  ================================================================================
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

from headlab.errors import ConfigError
from headlab.interpret.heads import examples as C
from headlab.models.fanout import blocks, fan_out
from headlab.models.tensor_parallel import by_heads

KINDS = ("zero", "mean", "resample", "uniform")


@contextmanager
def head_hooks(adapter, fn):
    """``fn(layer, z (B, n, L, d), heads) -> z or None`` edits every layer's per-head outputs z, where ``heads``
    (a range) are the global indices of the n heads ``z`` holds: every head of the layer, or this rank's on a
    model sharded by tensor parallelism (the edit lands where the heads live; nothing is gathered, and gradients
    flow through it). Before the gates, on every backend (the adapter's ``z`` sites)."""
    if not hasattr(adapter, "hooks"):  # no hook sites: a pre-hook on W^O's input sees every head
        with C.pre_hooks(adapter, lambda layer, z: fn(layer, z, range(z.shape[1]))):
            yield
        return

    def site_fn(layer):
        def edit(z, site, heads):
            new = fn(layer, z, heads)
            return z if new is None else new

        return by_heads(edit)

    with adapter.hooks({adapter.site_name(layer, "z"): site_fn(layer) for layer in range(adapter.n_layers)}):
        yield


@contextmanager
def value_hooks(adapter, store: dict):
    """Record every layer's values ``(rows, L, Hkv_l * d)`` into ``store[layer]`` during a forward
    (through the adapter's ``v`` site, so on every family and backend alike; on a sharded model, this rank's
    kv heads, which are the ones its query heads read)."""

    layer_of = {adapter.site_name(layer, "v"): layer for layer in range(adapter.n_layers)}

    def record(v, site, heads):  # v: (B, Hkv, L, d)
        store[layer_of[site]] = v.transpose(1, 2).reshape(v.shape[0], v.shape[2], -1)
        return v

    with adapter.hooks({g: by_heads(record) for g in adapter.sites("v")}):
        yield


def mean_z(adapter, data, *, over: str, backend: str) -> dict:
    """Reference means of z per layer: ``{"token": [ (H_l, d) ], "position": [ (H_l, Lmax, d) ]}``, every head in
    global order (on a sharded model each rank sums its own heads and the sums are gathered once, at the end)."""
    if over not in ("token", "position"):
        raise ConfigError(f"mean_over must be 'token' or 'position', got {over!r}")
    L = adapter.n_layers
    tok_sum: list = [None] * L  # a (H_l, d) sum per layer, once the layer has run
    pos_sum: list = [None] * L
    # real query rows per layer (an encoder-decoder's decoder layers count the decoder's tokens) and per position
    n_tok = [0.0] * L
    pos_cnts: list = [None] * L

    def fn(layer, z, heads):  # (B, H, Lq, d)
        b = current["batch"]
        real = b.query_mask(adapter, layer, z.shape[2])  # (B, Lq)
        if layer not in current["counted"]:  # each layer's rows once per batch (on every rank of a sharded model)
            current["counted"].add(layer)
            n_tok[layer] += float(real.sum())
            c = real.to(torch.float64).sum(0).cpu()  # (Lq,)
            prev_c = pos_cnts[layer]
            k = len(c) if prev_c is None else max(len(prev_c), len(c))
            pos_cnts[layer] = _pad1(c, k) if prev_c is None else _pad1(prev_c, k) + _pad1(c, k)
        m = real.to(z.dtype)
        s = (z * m[:, None, :, None]).sum((0, 2))  # (H, d)
        tok_sum[layer] = s if tok_sum[layer] is None else tok_sum[layer] + s
        if over == "position":
            p = (z * m[:, None, :, None]).sum(0)  # (H, Lq, d)
            prev = pos_sum[layer]
            if prev is None:
                pos_sum[layer] = p
            else:
                n = max(prev.shape[1], p.shape[1])
                pos_sum[layer] = _pad_len(prev, n) + _pad_len(p, n)
        return None

    current: dict = {}
    with torch.no_grad(), adapter.use_backend(backend), head_hooks(adapter, fn):
        for b in data:
            current["batch"], current["counted"] = b, set()
            adapter.forward(b.inputs)
    tp = adapter.placement
    if tp.sharded:  # each rank summed its heads: (H/world, ...) -> (H, ...) in global order
        tok_sum = [tp.gather(s[None], "z")[0] for s in tok_sum]
        pos_sum = [None if p is None else tp.gather(p[None], "z")[0] for p in pos_sum]
    token = [s / max(n, 1.0) for s, n in zip(tok_sum, n_tok)]
    out: dict[str, Any] = {"token": token}
    if over == "position":
        assert pos_cnts[0] is not None  # the data had a batch
        out["position"] = [
            ps / c.clamp_min(1.0).to(ps.device, ps.dtype)[None, :, None] for ps, c in zip(pos_sum, pos_cnts)
        ]
        out["position_count"] = pos_cnts[0]
        out["position_counts"] = pos_cnts  # per layer
    return out


def _pad_len(t: torch.Tensor, n: int) -> torch.Tensor:  # (H, L, d) -> (H, n, d)
    return torch.nn.functional.pad(t, (0, 0, 0, n - t.shape[1]))


def _pad1(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, n - t.shape[0]))


class Runner:
    """Runs configurations on batches: ``clean(batch)`` then ``run(batch, masks)``."""

    def __init__(
        self, adapter, *, kind: str, loss: str, backend: str, means: dict | None, max_rows: int, causal: bool
    ) -> None:
        if kind not in KINDS:
            raise ConfigError(f"unknown ablation kind {kind!r}; use one of {', '.join(KINDS)}")
        self.adapter, self.kind, self.loss, self.backend = adapter, kind, loss, backend
        self.means, self.max_rows, self.causal = means, max_rows, causal
        self.counts = adapter.layer_heads

    # -- the unablated pass ---------------------------------------------------------------------------------------
    def clean(self, b: C.Batch, *, keep_z: bool = False) -> dict:
        """Baseline per-example loss (and accuracy), the label-free reference, z of every layer if asked (the
        heads this rank holds: every head, unless the model is sharded; :meth:`every_head` gathers them)."""
        zs: dict[int, torch.Tensor] = {}

        def fn(layer, z, heads):
            if keep_z:
                zs[layer] = z.detach()
            return None

        with torch.no_grad(), self.adapter.use_backend(self.backend), head_hooks(self.adapter, fn):
            out = self.adapter.forward(b.inputs)
        ref = C.reference(self.loss, out, b)
        loss0 = C.per_example(self.loss, out, b, ref)
        return {"ref": ref, "loss": loss0, "acc": C.accuracy(out, b), "z": zs}

    def rows_of(self, b: C.Batch):
        """``(layer, length) -> (B, length)`` real query rows of batch ``b`` at each layer."""
        return lambda layer, length: b.query_mask(self.adapter, layer, length)

    def causal_at(self, layer: int) -> bool:
        """Does layer ``layer`` attend causally (an encoder-decoder's decoder self-attention; not its encoder's or
        its cross-attention)?"""
        stacks = self.adapter.stacks
        if "encoder" in stacks:
            return layer in stacks.get("decoder", ())
        return self.causal

    def every_head(self, zs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """:meth:`clean`'s z of every layer with every head, in global order (gathered on a sharded model)."""
        tp = self.adapter.placement
        return {layer: tp.gather(z, "z") for layer, z in sorted(zs.items())} if tp.sharded else zs

    # -- ablated passes ---------------------------------------------------------------------------------------------
    def run(self, b: C.Batch, clean: dict, masks: torch.Tensor, advance=None) -> torch.Tensor:
        """Per-example loss ``(n_configs, B)`` with each configuration's heads ablated.

        ``masks``: bool ``(n_configs, n_layers, H)``; ``advance(n)``: called as each chunk of ``n``
        configurations finishes (the caller's progress)."""
        B = b.size
        per = max(1, self.max_rows // B)
        # Configurations ordered by their edits, layer by layer (lexicographically), so that a chunk's
        # configurations edit the same heads in as many early layers as possible: those layers run once
        # per example with the shared edit, and the chunk fans out at the first layer where its
        # configurations differ (headlab.models.fanout). Results come back in the given order.
        keys = [tuple(row) for row in masks.flatten(1).tolist()]  # layer-major bits of each configuration
        order = sorted(range(masks.shape[0]), key=keys.__getitem__)
        out = None
        for s in range(0, len(order), per):
            idx = torch.as_tensor(order[s : s + per])
            got = self._run_chunk(b, clean, masks[idx], start=_first_difference(masks[idx]))  # (chunk, B)
            out = got.new_empty(masks.shape[0], B) if out is None else out
            out[idx.to(got.device)] = got
            if advance is not None:
                advance(len(idx))
        assert out is not None  # at least one chunk ran
        return out

    def _run_chunk(self, b: C.Batch, clean: dict, masks: torch.Tensor, start: int = 0) -> torch.Tensor:
        c, B = masks.shape[0], b.size
        rep = {k: v.repeat(c, *([1] * (v.dim() - 1))) for k, v in b.inputs.items()}  # (c*B, L)
        rb = C.Batch(rep, None if b.labels is None else b.labels.repeat(c), b.index.repeat(c), b.model)
        # layers below `start`, where every configuration of the chunk makes the same edit, run once per
        # example (B rows) with that edit; from `start` on, c copies (c * B rows)
        shared = blocks(self.adapter) is not None
        values: dict[int, torch.Tensor] = {}

        def fn(layer, z, heads):  # z (c*B, H, Lq, d), or (B, H, Lq, d) below the fan-out; heads: their global indices
            H = z.shape[1]
            n = z.shape[0] // B  # copies in this tensor: c, or 1 below the fan-out
            m = masks[:n, layer, heads.start : heads.stop]  # (n, H): every configuration, or the first (all agree)
            if not bool(m.any()):
                return None
            z5 = z.view(n, B, H, *z.shape[2:])  # (n, B, H, Lq, d)
            mk = b.query_mask(self.adapter, layer, z.shape[2])  # (B, Lq) real query rows of this layer
            r = self._replacement(layer, z5, clean, values, mk, mk.sum(-1), heads, b)
            return torch.where(m[:, None, :, None, None].to(z.device), r, z5).reshape(z.shape)

        ctx = value_hooks(self.adapter, values) if self.kind == "uniform" else _null()
        # uniform reads the layer's values per copy: its attention core must run per copy too
        fan = fan_out(self.adapter, start, c, share_attention=self.kind != "uniform") if shared and c > 1 else _null()
        with torch.no_grad(), self.adapter.use_backend(self.backend), ctx, head_hooks(self.adapter, fn), fan:
            out = self.adapter.forward(b.inputs if shared or c == 1 else rep)
        ref = {k: v.repeat(c, *([1] * (v.dim() - 1))) for k, v in clean["ref"].items()}
        return C.per_example(self.loss, out, rb, ref).view(c, B)

    def _replacement(self, layer, z5, clean, values, mask, lens, heads: range, b: C.Batch) -> torch.Tensor:
        """What replaces z of the heads ``heads`` (global indices; ``z5`` holds them): ``(c or 1, B, H, Lq, d)``
        or broadcastable to it. Tables indexed by global head are sliced with ``heads``; the clean z and the
        values hold this rank's heads already."""
        c, B, H, Lq, d = z5.shape
        sel = slice(heads.start, heads.stop)
        if self.kind == "zero":
            return torch.zeros((), dtype=z5.dtype, device=z5.device)
        if self.kind == "mean":
            assert self.means is not None  # kind "mean" is built with its means
            tok = self.means["token"][layer][sel].to(z5.dtype)  # (H, d)
            if "position" not in self.means:
                return tok[None, None, :, None, :]
            pos = self.means["position"][layer][sel].to(z5.dtype)  # (H, Lmax, d)
            cnt = self.means.get("position_counts", [self.means["position_count"]] * (layer + 1))[layer]
            n = min(Lq, pos.shape[1])
            r = tok[:, None, :].expand(H, Lq, d).clone()
            seen = (cnt[:n] > 0).to(z5.device)
            r[:, :n][:, seen] = pos[:, :n][:, seen]
            return r[None, None]
        if self.kind == "resample":
            zc = clean["z"][layer]  # (B, H, Lq, d) from the unablated run (this rank's heads)
            donor = (torch.arange(B, device=zc.device) + 1) % B  # (B,)
            pos = torch.arange(Lq, device=zc.device)[None, :].expand(B, Lq)
            pos = torch.minimum(pos, (lens[donor] - 1).clamp_min(0)[:, None])  # (B, Lq)
            r = zc[donor]  # (B, H, Lq, d)
            r = torch.gather(r, 2, pos[:, None, :, None].expand(B, H, Lq, d))
            return r[None]
        # uniform: mean of the visible values (of this rank's kv heads, the ones its query heads read)
        v = values[layer]  # (c*B, Lk, Hkv*d)
        Hkv = v.shape[-1] // d
        v = v.view(c, B, v.shape[1], Hkv, d)
        keys = b.key_mask(self.adapter, layer, v.shape[2])  # (B, Lk): cross-attention reads the encoder's tokens
        vis = keys[:, None, :].expand(B, Lq, keys.shape[1])  # (B, Lq, Lk) real keys
        if self.causal_at(layer):
            vis = vis & torch.ones(Lq, keys.shape[1], dtype=torch.bool, device=keys.device).tril()[None]
        w = vis.to(v.dtype)
        w = w / w.sum(-1, keepdim=True).clamp_min(1.0)
        u = torch.einsum("bij,cbjkd->cbkid", w, v)  # (c, B, Hkv, Lq, d)
        return u.repeat_interleave(H // Hkv, dim=2)  # query head h reads kv head h // (H // Hkv)


def _first_difference(masks: torch.Tensor) -> int:
    """The first layer where the configurations ``(c, n_layers, H)`` do not all edit the same heads
    (the last layer when they all agree: nothing is gained by fanning out earlier)."""
    differs = (masks != masks[:1]).flatten(2).any(-1).any(0)  # (n_layers,)
    return int(differs.float().argmax()) if bool(differs.any()) else masks.shape[1] - 1


@contextmanager
def _null():
    yield
