"""Value-aware attention norms (Kobayashi et al. 2020; residual mode: Kobayashi et al. 2021):
:func:`attention_norms`.

A weight alpha_ij says how much query i looks at key j; what reaches i is ``alpha_ij f_h(x_j)``, whose
size also depends on the value vector and on W^O. Per head the norm map is
``||alpha^h_ij f_h(x_j)|| = alpha^h_ij ||f_h(x_j)||``; per layer ``||sum_h alpha^h_ij f_h(x_j)||``, from
the per-token Gram matrices (:mod:`headlab.interpret.flow.gram`, which also says exactly what the
residual mode includes).

Three ways to read them:

* maps (default): ``per_head[l]`` ``(H, n, n)`` and ``layer[l]`` ``(n, n)``;
* ``rows=[i, ...]``: exact rows for chosen queries, ``row_per_head[l]`` ``(H, R, n)``, ``row_layer[l]``
  ``(R, n)``, in ``O(R n)`` memory;
* ``stream=True``: the per-query and per-key summaries (:class:`NormSummary`) in O(n) memory, one
  pass over key tiles per layer; e.g. ``sum_i ||alpha_ij f(x_j)|| = ||f(x_j)|| sum_i alpha_ij``.

    >>> import torch, headlab
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, causal=True)).eval()
    >>> ids = torch.randint(0, 50, (1, 12))
    >>> r = headlab.attention_norms(m, ids)
    >>> r.per_head[1].shape, r.layer[1].shape
    (torch.Size([4, 12, 12]), torch.Size([12, 12]))
    >>> s = headlab.attention_norms(m, ids, stream=True, key_positions=[0])
    >>> torch.allclose(s.summaries[1].received_norm, r.per_head[1].sum(1), atol=1e-5)
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

import headlab.checks as checks
from headlab.errors import ConfigError
from headlab.interpret.flow.gram import NormGram, gram, head_tile, layer_tile
from headlab.interpret.flow.record import Recording, check_layers, record
from headlab.interpret.flow.tiles import prob_tiles
from headlab.results import envelope

Mode = Literal["attention", "residual"]
_STREAM_BLOCK = 512


@dataclass
class NormSummary:
    """Per-query / per-key summaries of one layer's weight and norm maps (``M`` chosen keys).

    Per head (H rows): ``received_weight`` sum_i alpha_ij and ``received_norm`` sum_i ||alpha_ij f(x_j)||
    ``(H, n)``; ``key_weight`` alpha_ij and ``key_norm_share`` ||alpha_ij f(x_j)|| / sum_j' ||alpha_ij' f(x_j')||
    at the chosen keys ``(H, n, M)``; ``mean_distance_weight`` sum_j alpha_ij |i - j| and
    ``mean_distance_norm`` (the same, weighted by the norms, normalised) ``(H, n)``.
    The layer map: ``received`` ``(n,)``, ``key_share`` ``(n, M)``, ``mean_distance`` ``(n,)``.
    """

    key_positions: list[int]
    received_weight: torch.Tensor
    received_norm: torch.Tensor
    key_weight: torch.Tensor
    key_norm_share: torch.Tensor
    mean_distance_weight: torch.Tensor
    mean_distance_norm: torch.Tensor
    received: torch.Tensor
    key_share: torch.Tensor
    mean_distance: torch.Tensor

    def to_json(self) -> dict:
        out = {"key_positions": self.key_positions}
        for k, v in self.__dict__.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.tolist()
        return out


@dataclass
class NormsResult:
    """What :func:`attention_norms` returns; dicts are keyed by layer."""

    mode: str
    layers: list[int]
    n: int
    tokens: list[str] | None
    per_head: dict[int, torch.Tensor] = field(default_factory=dict)  # (H, n, n)
    layer: dict[int, torch.Tensor] = field(default_factory=dict)  # (n, n)
    rows: list[int] | None = None
    row_per_head: dict[int, torch.Tensor] = field(default_factory=dict)  # (H, R, n)
    row_layer: dict[int, torch.Tensor] = field(default_factory=dict)  # (R, n)
    summaries: dict[int, NormSummary] = field(default_factory=dict)
    weights: dict[int, torch.Tensor] = field(default_factory=dict)  # (H, n, n) the attention maps (maps mode)
    notes: list[str] = field(default_factory=list)  # what was left out and why (cross-attention in residual mode)
    stacks: dict[str, list[int]] = field(default_factory=dict)  # an encoder-decoder's stacks: their layers answered

    def _repr_html_(self) -> str:
        """This result's page inline in a notebook (headlab's shell in a sandboxed frame; no network)."""
        from headlab.interpret import shell
        from headlab.interpret.flow.page import flow_page

        return shell.inline(flow_page(self))

    def to_json(self) -> dict:
        d = {"mode": self.mode, "layers": self.layers, "n": self.n, "tokens": self.tokens, "rows": self.rows}
        for name in ("per_head", "layer", "row_per_head", "row_layer"):
            got = getattr(self, name)
            if got:
                d[name] = {str(l): t.tolist() for l, t in got.items()}
        if self.summaries:
            d["summaries"] = {str(l): s.to_json() for l, s in self.summaries.items()}
        if self.notes:
            d["notes"] = list(self.notes)
        if self.stacks:
            d["stacks"] = {k: list(v) for k, v in self.stacks.items()}
        return envelope("norms", d, settings={"mode": self.mode, "layers": self.layers, "rows": self.rows})


def maps_from_pattern(pattern: torch.Tensor, ng: NormGram) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per_head (H, nq, nk), layer (nq, nk))`` from the weights ``pattern (H, nq, nk)`` (square but for
    cross-attention, whose queries are decoder tokens and keys encoder tokens)."""
    p = pattern.to(ng.G.dtype)
    pos = torch.arange(p.shape[-2], device=p.device)
    return head_tile(p, pos, 0, p.shape[-1], ng), layer_tile(p, pos, 0, p.shape[-1], ng)


def check_positions(name: str, value, n: int) -> list[int]:
    vals = [value] if isinstance(value, int) else list(value)
    if not vals:
        raise ConfigError(f"{name} is empty; give at least one token position")
    return [
        checks.index(
            name,
            v,
            n,
            message="{name}: position {value!r} out of range for {length} tokens (0..{high}, "
            "negatives count from the end)",
        )
        for v in vals
    ]


def summarise(
    q, k, lse, ng: NormGram, *, scale: float, causal: bool, key_positions: list[int], block: int = _STREAM_BLOCK
) -> NormSummary:
    """One pass over the probability tiles of one layer: every :class:`NormSummary` field, O(n) memory."""
    H, n, _ = q.shape
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    z = lambda *s: torch.zeros(*s, dtype=ct, device=dev)
    M = len(key_positions)
    kp = torch.tensor(key_positions, device=dev)
    rec_w, rec_n, rec_l = z(H, n), z(H, n), z(n)
    key_w, key_n, key_l = z(H, n, M), z(H, n, M), z(n, M)
    row_n, row_l = z(H, n), z(n)  # sum_j of the norm maps
    dist_w, dist_n, dist_l = z(H, n), z(H, n), z(n)
    jpos = torch.arange(n, device=dev, dtype=ct)
    for r0, r1, c0, c1, p in prob_tiles(q, k, lse, scale=scale, causal=causal, block=block):
        qpos = torch.arange(r0, r1, device=dev)
        d = (qpos.view(-1, 1).to(ct) - jpos[c0:c1].view(1, -1)).abs_()  # (bq, bk)
        hn = head_tile(p, qpos, c0, c1, ng)  # (H, bq, bk)
        ln = layer_tile(p, qpos, c0, c1, ng)  # (bq, bk)
        rec_w[:, c0:c1] += p.sum(1)
        rec_n[:, c0:c1] += hn.sum(1)
        rec_l[c0:c1] += ln.sum(0)
        row_n[:, r0:r1] += hn.sum(-1)
        row_l[r0:r1] += ln.sum(-1)
        dist_w[:, r0:r1] += (p * d).sum(-1)
        dist_n[:, r0:r1] += (hn * d).sum(-1)
        dist_l[r0:r1] += (ln * d).sum(-1)
        inside = ((kp >= c0) & (kp < c1)).nonzero(as_tuple=True)[0]
        if inside.numel():
            cols = kp[inside] - c0
            key_w[:, r0:r1, inside] = p[:, :, cols]
            key_n[:, r0:r1, inside] = hn[:, :, cols]
            key_l[r0:r1, inside] = ln[:, cols]
    safe = lambda t: torch.where(t > 0, t, torch.ones((), dtype=ct))
    return NormSummary(
        key_positions,
        rec_w,
        rec_n,
        key_w,
        key_n / safe(row_n).unsqueeze(-1),
        dist_w,
        dist_n / safe(row_n),
        rec_l,
        key_l / safe(row_l).unsqueeze(-1),
        dist_l / safe(row_l),
    )


def _rows(q, k, lse, ng, positions, *, scale, causal):
    pos = torch.tensor(positions, device=q.device)
    qs, ls = q[:, pos], lse[:, pos]
    heads, layer = [], []
    for _, _, c0, c1, p in prob_tiles(qs, k, ls, scale=scale, causal=causal, block=1 << 30, q_pos=pos):
        heads.append(head_tile(p, pos, c0, c1, ng))
        layer.append(layer_tile(p, pos, c0, c1, ng))
    return torch.cat(heads, -1), torch.cat(layer, -1)


def attention_norms(
    loaded,
    text_or_inputs,
    *,
    layers=None,
    mode: Mode = "attention",
    backend="auto",
    rows=None,
    stream: bool = False,
    key_positions=None,
    stack: str | None = None,
) -> NormsResult:
    """Norm maps ``||alpha f(x)||`` of every head and of each layer, for one input.

    Args:
        loaded: a :class:`~headlab.models.loader.LoadedModel`, a model adapter or a supported model.
        text_or_inputs: one text (with a LoadedModel), an ``input_ids`` tensor ``(1, n)`` or a dict.
        layers: layer indices (default all; negatives count from the end).
        mode: ``"attention"`` (Kobayashi et al. 2020: attention and W^O) or ``"residual"`` (2021: with
            the residual and the layer norm's linear part; see :mod:`headlab.interpret.flow.gram`).
        backend: the exact backend the model runs on (an approximate one is refused).
        rows: query positions: exact rows of the maps without the maps.
        stream: compute :class:`NormSummary` per layer in O(n) memory instead of the maps.
        key_positions: the chosen keys of the summaries (default the first and the last token).
        stack: for an encoder-decoder, ``"encoder"``, ``"decoder"`` or ``"cross"``: that stack's layers only.
            None: every stack's (each map is its own stack's size: a decoder layer's ``n_dec x n_dec``, a
            cross-attention layer's ``n_dec x n_enc``), and the result's ``stacks`` says which layers each
            stack's are, with a note.

    Returns:
        :class:`NormsResult`.
    """
    if mode not in ("attention", "residual"):
        raise ConfigError(f"unknown mode {mode!r}; use 'attention' (Kobayashi et al. 2020) or 'residual' (2021)")
    streaming = bool(stream) or rows is not None
    notes: list[str] = []
    layers = _stack_layers(loaded, stack, layers)
    if mode == "residual" and layers is None:
        from headlab.models.loaded_model import resolve

        adapter = resolve(loaded)[0]
        cross = adapter.stacks.get("cross", [])
        if cross:  # an encoder-decoder: answer for the self-attention layers, say why cross-attention is left out
            layers = [l for l in range(adapter.n_layers) if l not in cross]
            notes.append(
                f"cross-attention layers {cross[0]}..{cross[-1]} have no residual mode (their residual "
                "belongs to the decoder token, not to any key): left out; use mode='attention' for them"
            )
    rec: Recording = record(
        loaded, text_or_inputs, layers, maps=not streaming, residual=mode == "residual", backend=backend
    )
    n = rec.n
    row_pos = check_positions("rows", rows, n) if rows is not None else None
    kpos = check_positions("key_positions", key_positions if key_positions is not None else [0, n - 1], n)
    res = NormsResult(mode, sorted(rec.layers), n, rec.tokens, rows=row_pos, notes=notes)
    _say_stacks(res, rec.adapter)
    with torch.no_grad():
        for l, lr in rec.layers.items():
            ng = gram(rec.adapter, l, lr, mode)
            if not streaming:
                assert lr.pattern is not None  # recorded with maps
                res.weights[l] = lr.pattern
                res.per_head[l], res.layer[l] = maps_from_pattern(lr.pattern, ng)
                continue
            if row_pos is not None:
                res.row_per_head[l], res.row_layer[l] = _rows(
                    lr.q, lr.k, lr.lse, ng, row_pos, scale=rec.scale[l], causal=rec.causal
                )
            if stream:
                res.summaries[l] = summarise(
                    lr.q, lr.k, lr.lse, ng, scale=rec.scale[l], causal=rec.causal, key_positions=kpos
                )
    return res


def _stack_layers(loaded, stack: str | None, layers):
    """``layers`` within ``stack`` (all of its layers when ``layers`` is None); ``layers`` as given without one."""
    if stack is None:
        return layers
    from headlab.models.loaded_model import resolve

    adapter = resolve(loaded)[0]
    if stack not in adapter.stacks:
        raise ConfigError(f"unknown stack {stack!r}; this model has {', '.join(adapter.stacks)}")
    within = adapter.stacks[stack]
    if layers is None:
        return list(within)
    chosen = [l for l in check_layers(adapter, layers) if l in within]
    if not chosen:
        raise ConfigError(f"none of layers {layers} is in the stack {stack!r} (layers {within[0]}..{within[-1]})")
    return chosen


def _say_stacks(res: NormsResult, adapter) -> None:
    """On a model of several stacks: which of the answered layers each stack's are, in ``stacks`` and a note."""
    if len(adapter.stacks) < 2:
        return
    res.stacks = {k: [l for l in v if l in res.layers] for k, v in adapter.stacks.items()}
    res.stacks = {k: v for k, v in res.stacks.items() if v}
    res.notes.append(
        "an encoder-decoder: answered for the stacks "
        + ", ".join(f"{k} (layers {v[0]}..{v[-1]})" for k, v in res.stacks.items())
        + "; each map has its own stack's tokens (cross-attention: decoder queries x encoder keys)"
    )


def value_norms(loaded, text_or_inputs, *, layers=None, backend="auto") -> dict[int, torch.Tensor]:
    """``||f_h(x_j)||`` per layer, ``(H, n)``: the factor that turns a head's weight map into its norm map,
    ``||alpha^h_ij f_h(x_j)|| = alpha^h_ij ||f_h(x_j)||``, so a page that holds the weight maps needs only
    these ``H n`` numbers per layer for the norm maps. One forward recording the attention inputs only (or
    a :class:`~headlab.interpret.flow.record.Recording` passed as ``text_or_inputs``: no forward)."""
    rec = record(loaded, text_or_inputs, layers, maps=None, backend=backend)
    with torch.no_grad():
        return {l: gram(rec.adapter, l, lr, "attention").w for l, lr in sorted(rec.layers.items())}


__all__ = ["NormSummary", "NormsResult", "attention_norms", "maps_from_pattern", "summarise", "value_norms"]
