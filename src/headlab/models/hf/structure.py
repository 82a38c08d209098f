"""Adapting a Hugging Face model by its structure: :func:`discover` and :func:`adapt_by_structure`.

A model type no family declares is not refused by name. Every transformers v5 model computes attention
through the attention interface (``ALL_ATTENTION_FUNCTIONS``); headlab runs the model once on a few
tokens (:func:`headlab.models.inputs.example_inputs`) with a tracing implementation registered there and
reads what a declaration would say from what the call and the module tree show:

============================  =================================================================================
what                          how it is found
============================  =================================================================================
attention modules, stacks     the modules that call the attention function, in call order; an encoder-decoder's
                              encoder modules are those under ``get_encoder()``, its cross-attention the decoder
                              calls whose keys have the encoder's length
heads ``H``, ``Hkv``, ``d``   the shapes of q ``(B, H, L, d)`` and k, v ``(B, Hkv, L, d)`` in the call
W_V, W_Q, W_K                 the projection whose output, reshaped, *is* the v the call received (separate, or
                              fused ``[Q|K|V]``, per head or grouped, ``nn.Linear`` or ``Conv1D``); q and k are
                              the projections of ``H * d`` and ``Hkv * d`` features beside it (by name when both
                              counts are equal: ``q``/``query``, ``k``/``key``)
W^O                           the linear map whose input is the attention output merged to ``(B, L, H * d)``
norm layout                   the block's norms by what they read: pre (its output is the attention's input),
                              post (reads ``x + Attn``), sandwich (reads ``Attn`` alone), parallel (the block
                              adds a module's output beside ``x + Attn`` and no norm reads ``x + Attn``)
pruning's head counts         the attention module's integer attributes named for heads that hold H, Hkv,
                              H // Hkv or H * d
============================  =================================================================================

What structure cannot show (ALiBi computed inside a module, disentangled or latent attention) stays a
declaration (:data:`~headlab.models.hf.registry.REFUSED` says why a type is refused; a family class adapts
it). Nothing found here is trusted before :mod:`headlab.models.hf.verify` checks it on the loaded weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from headlab.errors import UnsupportedArchitectureError
from headlab.models.hf.family import HFAdapter, Norms
from headlab.models.hf.found_ops import cut_found as _cut
from headlab.models.hf.found_ops import no_norms as _no_norms
from headlab.models.hf.hybrid import describe, hybrid_attrs, token_mixers
from headlab.models.hf.layout import Layout, head_attrs, stack_layout
from headlab.models.hf.own_bridge import bridge
from headlab.models.hf.own_state import BRIDGED, bridge_of, computes_its_own
from headlab.models.hf.pinned import no_calls_reason
from headlab.models.hf.registry import BY_STRUCTURE, FAMILIES
from headlab.models.hf.seq2seq import EncoderDecoderAdapter
from headlab.models.hf.trace import TRACE, Call, out_features, refuse, trace
from headlab.models.hf.variants import repeated_calls_reason, stacks_reason
from headlab.models.hf.verify import config_key, verify
from headlab.models.inputs import example_inputs, input_kind, is_encoder_decoder
from headlab.models.projections import Separate


@dataclass
class Found:
    """The declaration structure gave for a model (see :func:`discover`)."""

    model_type: str
    shape: tuple[int, int, int, int]  # (H, Hkv, d, E)
    is_decoder: bool
    input_kind: str
    positions_seen: int
    layers: dict[str, str]  # stack -> path of its block list from model.base_model ("blocks", or encoder/decoder)
    layouts: dict[str, Layout]  # "blocks", or "encoder", "decoder", "cross"
    head_attrs: dict[str, str]
    kwargs: list[str]
    model_blocks: list[int] = field(default_factory=list)  # the model's index of each attention block (one stack)
    n_blocks: int = 0  # blocks in the model's list, attention or not (one stack)
    token_mixers: dict[int, str] = field(default_factory=dict)  # blocks mixing tokens beside attention (hybrid.py)

    def summary(self) -> dict:
        """JSON-ready description (what ``headlab models --check`` prints)."""
        H, Hkv, d, E = self.shape
        out: dict[str, Any] = {
            "model_type": self.model_type,
            "heads": H,
            "kv_heads": Hkv,
            "head_dim": d,
            "d_model": E,
            "decoder": self.is_decoder,
            "input": self.input_kind,
            "layers": self.layers,
            "head_attrs": self.head_attrs,
        }
        if self.n_blocks > len(self.model_blocks) > 0:  # blocks without attention (hybrid.py)
            out["attention_blocks"] = f"{self.model_blocks} of {self.n_blocks} (the others have no heads)"
        if self.token_mixers:
            out["token_mixers"] = describe(self.token_mixers, self.model_blocks)
        for stack, lay in self.layouts.items():
            p = lay.projections
            proj = (f"separate({p.q}, {p.k}, {p.v})" if isinstance(p, Separate) else f"fused({p.name}, {p.order})") + (
                ", Conv1D" if p.conv1d else ""
            )
            out[stack] = {
                "attention": lay.attention,
                "projections": proj,
                "out": lay.out.path,
                "norms": _norms_text(lay.norms) if lay.norms else f"not identified ({lay.norms_why})",
                "notes": lay.notes,
            }
            if lay.value_norm:
                out[stack]["value_norm"] = f"{lay.value_norm} (per head, after W_V: W_V-based statistics refused)"
        return out


def _norms_text(n: Norms) -> str:
    scaled = f", branch scaled by {n.branch_scale}" if n.branch_scale else ""
    if n.post is not None:
        kind = "sandwich" if n.post_reads == "branch" else "post"
        return f"{kind} (pre={n.pre}, post={n.post}, {n.kind}{', 1 + w' if n.offset else ''}{scaled})"
    if n.parallel:
        return f"parallel (pre={n.pre}, beside {n.parallel}{scaled})"
    return f"pre ({n.pre}{scaled})" if n.pre else f"none around the attention{scaled}"


def _split_block(path: str, model_type: str) -> tuple[str, str]:
    """``("encoder.layer", "3.attention.self")``-style split of an attention path at its block index."""
    parts = path.split(".")
    cut = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if cut is None or cut == 0:
        raise refuse(model_type, f"its attention module {path!r} is not inside a list of blocks")
    if cut == len(parts) - 1:
        raise refuse(
            model_type,
            f"its attention modules form a list of their own ({'.'.join(parts[:cut])!r}, beside parallel lists of "
            "norms and feed-forward modules, as XLM's), not a module inside each block",
        )
    return ".".join(parts[:cut]), ".".join(parts[cut + 1 :])


def discover(model: Any) -> Found:  # a transformers model
    """Read a Hugging Face model's attention layout from its structure (see the module docstring).

    Raises :class:`~headlab.errors.UnsupportedArchitectureError` naming what could not be found.
    """
    cfg = model.config
    mt = str(getattr(cfg, "model_type", type(model).__name__))
    root = model.base_model
    try:
        x = example_inputs(model, tokens=8)
    except Exception as e:  # noqa: BLE001  (a config without the fields an input needs)
        raise refuse(mt, f"headlab cannot build an input for it from its config ({type(e).__name__}: {e})") from None
    was_training = model.training
    model.eval()
    try:
        calls = trace(model, x)
        if not calls and bridge(model, x, mt) is not None:  # modules computing attention with their own math
            calls = trace(model, x)
    except UnsupportedArchitectureError as e:  # the bridge's, naming a module and an op
        if str(e).startswith("no headlab adapter"):
            raise
        raise refuse(mt, str(e)) from None
    except Exception as e:  # noqa: BLE001  (any failure of the trial run: the type is refused, saying why)
        raise refuse(
            mt,
            f"the model does not run through transformers' attention interface "
            f"({type(e).__name__}: {str(e).splitlines()[0][:160]})",
        ) from None
    finally:
        model.train(was_training)
    if not calls:  # transformers' pin to eager, or attention computed in the model's own modules
        raise refuse(mt, no_calls_reason(model, x))
    kwargs = sorted({k for c in calls for k in c.kwargs})
    if "s_aux" in kwargs:
        raise refuse(
            mt,
            "its attention modules pass 's_aux' (learned attention sinks) to the attention function, "
            "which headlab's backends do not compute",
        )
    order: list[nn.Module] = []
    for c in calls:
        if c.module not in order:
            order.append(c.module)
    if len(order) < len(calls):  # shared across layers (ALBERT), or several maps per layer (differential)
        named = {id(m): p for p, m in model.named_modules()}
        raise refuse(mt, repeated_calls_reason(model, x, order, calls, named))
    shapes = {(c.q.shape[1], c.k.shape[1], c.q.shape[-1], c.v.shape[-1]) for c in calls}
    if len(shapes) > 1:
        raise refuse(
            mt,
            f"its layers differ in heads or head size ({sorted(shapes)}: (H, Hkv, d_qk, d_v)), as in a "
            "hierarchical model such as Swin; headlab's view has one head count and width per model",
        )
    H, Hkv, dq, dv = shapes.pop()
    if dq != dv:
        raise refuse(
            mt,
            f"its queries and keys have {dq} features per head but its values {dv}: latent or "
            "decoupled attention (DeepSeek's MLA), whose per-head W_Q, W_K, W_V are not single matrices",
        )
    if H % Hkv:
        raise refuse(mt, f"{H} query heads do not share {Hkv} key/value heads evenly")
    d = dq
    paths = {id(m): p for p, m in root.named_modules()}
    if any(id(m) not in paths for m in order):
        raise refuse(mt, "its attention modules are not under model.base_model")
    if any(c.q.shape[0] != c.k.shape[0] or c.q.shape[0] != next(iter(x.values())).shape[0] for c in calls):
        raise refuse(
            mt,
            "its attention runs over a batch axis that is not the input's (windows or chunks folded "
            "into the batch, as Swin's shifted windows do)",
        )

    # stacks: one, or encoder / decoder / cross for an encoder-decoder
    stacks: dict[str, list[Call]] = {}
    if is_encoder_decoder(model):
        enc = model.get_encoder() if hasattr(model, "get_encoder") else None
        enc_ids = {id(m) for m in enc.modules()} if enc is not None else set()
        L_enc = next((c.k.shape[2] for c in calls if id(c.module) in enc_ids), None)
        for c in calls:
            stack = (
                "encoder"
                if id(c.module) in enc_ids
                else ("cross" if c.k.shape[2] == L_enc and c.q.shape[2] != L_enc else "decoder")
            )
            stacks.setdefault(stack, []).append(c)
        if set(stacks) != {"encoder", "decoder", "cross"}:
            raise refuse(mt, stacks_reason(model, stacks, enc))
    else:
        stacks["blocks"] = calls

    layers: dict[str, str] = {}
    blocks0: dict[str, nn.Module] = {}
    attn_rel: dict[str, str] = {}
    hybrid: tuple[list[int], int, dict[int, str]] = ([], 0, {})
    for stack, cs in stacks.items():
        split = [_split_block(paths[id(c.module)], mt) for c in cs]
        lists = {s[0] for s in split}
        rels = {s[1] for s in split}
        if len(lists) != 1 or len(rels) != 1:
            raise refuse(
                mt,
                f"its {stack} attention modules are not at one place in one list of blocks "
                f"({sorted(paths[id(c.module)] for c in cs)[:3]} ...)",
            )
        blist = root.get_submodule(lists.pop())
        n_blocks = len(blist) if hasattr(blist, "__len__") else -1
        index = [int(paths[id(c.module)][len(split[0][0]) + 1 :].split(".")[0]) for c in cs]
        if n_blocks != len(cs) and (stack != "blocks" or index != sorted(set(index)) or n_blocks < len(cs)):
            raise refuse(mt, f"its {stack} has {n_blocks} blocks but {len(cs)} attention calls")
        layers["encoder" if stack == "encoder" else ("decoder" if stack != "blocks" else "blocks")] = split[0][0]
        attn_rel[stack] = rels.pop()
        blocks0[stack] = root.get_submodule(f"{split[0][0]}.{index[0]}")
        if stack == "blocks":  # blocks without attention have no heads; all are tested for mixing tokens
            mixing = token_mixers(model, x, list(blist), {i: c.module for i, c in zip(index, cs)})
            hybrid = (index, n_blocks, mixing)

    layouts = {
        stack: stack_layout(model, x, blocks0[stack], attn_rel[stack], cs[0], H, Hkv, d, mt, stack)
        for stack, cs in stacks.items()
    }
    E = out_features(layouts[next(iter(layouts))].out_module)
    attn0 = calls[0].module
    heads = head_attrs(attn0, H, Hkv, d)
    selves = stacks.get("decoder", stacks.get("blocks"))
    assert selves is not None  # a model has a decoder stack or one stack of blocks
    first_self = selves[0].module
    is_decoder = bool(getattr(first_self, "is_causal", False)) and not is_encoder_decoder(model)
    seen = max(c.k.shape[2] for c in calls)
    return Found(
        model_type=mt,
        shape=(H, Hkv, d, E),
        is_decoder=is_decoder,
        input_kind=input_kind(model),
        positions_seen=int(seen),
        layers=layers,
        layouts={s: lay.layout for s, lay in layouts.items()},
        head_attrs=heads,
        kwargs=kwargs,
        model_blocks=hybrid[0],
        n_blocks=hybrid[1],
        token_mixers=hybrid[2],
    )


# -- the adapter class structure gives -----------------------------------------------------------------------------

_FOUND: dict[str, Found] = {}


def adapter_class_for(model: nn.Module) -> tuple[type[HFAdapter], Found]:
    """An :class:`HFAdapter` subclass declaring what :func:`discover` found (cached per config)."""
    key = config_key(model)
    found = _FOUND.get(key)
    if found is None:
        found = _FOUND[key] = discover(model)
        if bridge_of(model) is not None:
            BRIDGED.add(key)
    elif computes_its_own(
        model, key
    ):  # another instance of a class whose modules compute attention with their own math
        bridge(model, example_inputs(model, tokens=8), found.model_type)
    H, Hkv, d, E = found.shape
    name = "".join(p.capitalize() for p in found.model_type.replace("-", "_").split("_")) + "StructureAdapter"
    limits = {}
    for stack, lay in found.layouts.items():
        if lay.norms is None and stack != "cross":
            limits["norms"] = f"attention mode only ({lay.norms_why})"
    attrs = dict(
        family=found.model_type,
        model_types=(found.model_type,),
        by_structure=True,
        found=found,
        description=f"{found.model_type} (adapted by structure)",
        is_decoder=found.is_decoder,
        head_attrs=found.head_attrs,
        positions="by structure",
        limits=limits,
        stock_config=False,
        shape=classmethod(lambda cls, cfg: found.shape),
        max_positions=classmethod(lambda cls, cfg: _max_positions(cfg, found)),
    )
    vnorms = {lay.value_norm for lay in found.layouts.values()}
    if len(vnorms) > 1:
        raise refuse(found.model_type, f"its stacks differ in their value norms ({sorted(map(str, vnorms))})")
    attrs["value_norm"] = vnorms.pop()
    if "blocks" in found.layouts:
        lay = found.layouts["blocks"]
        attrs.update(
            layers=found.layers["blocks"],
            attention=lay.attention,
            projections=lay.projections,
            out=lay.out,
            norms=lay.norms or Norms(),
        )
        if lay.norms is None:
            attrs["attention_norm"] = _no_norms(lay.norms_why)
        attrs["cut_heads"] = _cut
        attrs.update(hybrid_attrs(found))
        return type(name, (HFAdapter,), attrs), found
    enc, dec, cross = found.layouts["encoder"], found.layouts["decoder"], found.layouts["cross"]
    attrs.update(
        encoder_layers=found.layers["encoder"],
        decoder_layers=found.layers["decoder"],
        attention=enc.attention,
        decoder_attention=dec.attention,
        cross=cross.attention,
        projections=enc.projections,
        out=enc.out,
        decoder_out=dec.out,
        cross_out=cross.out,
        norms=enc.norms or Norms(),
        decoder_norms=dec.norms or Norms(),
    )
    if enc.projections != dec.projections or enc.projections != cross.projections:
        raise refuse(found.model_type, "its encoder, decoder and cross-attention name their projections differently")
    attrs["cut_heads"] = _cut
    if enc.norms is None or dec.norms is None:
        attrs["attention_norm"] = _no_norms((enc.norms_why if enc.norms is None else dec.norms_why))
    return type(name, (EncoderDecoderAdapter,), attrs), found


def _max_positions(cfg, found: Found) -> int:
    for n in ("max_position_embeddings", "n_positions", "max_positions", "max_target_positions", "max_seq_len"):
        v = getattr(cfg, n, None)
        if isinstance(v, int) and v > 0:
            return v
    if found.input_kind != "input_ids":  # patches or frames: what the config's fixed input makes
        return found.positions_seen
    return 1 << 20  # relative or rotary positions with no table: no limit the config states


def _signature(fam) -> dict:
    """What a family's structure looks like: projections' layout, W^O's kind, norm layout, stacks, decoding."""
    from headlab.models.hf.support import norm_layout_of

    p = fam.__dict__.get("projections", getattr(fam, "projections", None))
    proj = getattr(p, "order", "separate") if p is not None and not isinstance(p, property) else "?"
    conv = bool(getattr(p, "conv1d", False)) if p is not None and not isinstance(p, property) else False
    return {
        "projections": proj,
        "conv1d": conv,
        "norms": norm_layout_of(fam),
        "stacks": issubclass(fam, EncoderDecoderAdapter),
        "decoder": bool(fam.is_decoder),
    }


def nearest_by_structure(model_type: str) -> str | None:
    """The registered family whose declared structure is nearest the one found for ``model_type`` (by
    :mod:`headlab.models.hf.structure` in this process), or None when nothing was found for it."""
    from headlab.models.hf.support import norm_layout_of

    found = next((f for f in _FOUND.values() if f.model_type == model_type), None)
    if found is None:
        return None
    lay = next(iter(found.layouts.values()))
    p = lay.projections
    mine = {
        "projections": getattr(p, "order", "separate"),
        "conv1d": bool(p.conv1d),
        "norms": norm_layout_of(type("F", (), {"norms": lay.norms})) if lay.norms else "?",
        "stacks": "encoder" in found.layouts,
        "decoder": found.is_decoder,
    }
    best = max(FAMILIES, key=lambda fam: sum(_signature(fam)[k] == v for k, v in mine.items()), default=None)
    return None if best is None else best.family


def max_positions_of(config) -> int:
    """The longest input of an undeclared type: from the structure found for it, else its config's position count."""
    found = next((f for f in _FOUND.values() if f.model_type == getattr(config, "model_type", None)), None)
    if found is not None:
        return _max_positions(config, found)
    return HFAdapter.max_positions(config)


def adapt_by_structure(model: nn.Module, *, check: bool = True):
    """The adapter of a model no family declares: discovered, then verified on the loaded weights
    (:func:`headlab.models.hf.verify.verify`, cached per config). A failed check is an
    :class:`~headlab.errors.UnsupportedArchitectureError` naming it, by how much, and what to declare."""
    cls, found = adapter_class_for(model)
    adapter = cls(model)
    if check:
        try:
            verdict = verify(adapter)
        except BaseException:
            adapter.close()
            raise
        if not verdict.passed:
            adapter.close()
            raise UnsupportedArchitectureError(verdict.refusal())
    return adapter


BY_STRUCTURE.update(adapt=adapt_by_structure, max_positions=max_positions_of, nearest=nearest_by_structure)

__all__ = ["Found", "Layout", "TRACE", "adapt_by_structure", "adapter_class_for", "config_key", "discover", "trace"]
