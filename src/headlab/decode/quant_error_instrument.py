"""``headlab kv error``: where a quantized KV cache's error comes from, measured without decoding, as an instrument
of the study runner.

For each task of the RULER-style suite (:mod:`headlab.decode.suite`), the runner's one recording holds every
layer's queries, keys, values and attention input for the context followed by the question. Each layer's attention
output at the question's queries is computed with the context's keys and values held as a quantizer would hold
them (the question's own exact), and compared with the same attention on keys and values rounded to float16 (a
16-bit cache held): the relative error ``||o - o_16|| / ||o_16||``, per layer and variant, averaged over tasks and
layers. With ``--at answer`` the error is read instead at the queries that decode the answer (the question's last
token and the answer the model gives with its full cache, greedy, up to the task's ``max_new_tokens``, all but its
last token appended to the prompt), the question's and the answer's keys and values exact. The variants, at
``--bits`` bits and groups of ``--group``:

- ``kivi``: KIVI (Liu et al. 2024): keys per channel in groups of tokens (a last partial group exact, as the store
  holds it with ``residual=0``), values per token in groups of channels (:mod:`headlab.decode.quant`);
- ``keys only`` / ``values only``: one of the two quantized, the other exact;
- ``keys g/2`` / ``keys g*2``: the key group halved / doubled;
- ``keys per token``: keys quantized as the values are, per token in groups of ``group`` channels (the layout of
  transformers' ``QuantizedCache`` at its defaults, ``axis_key=0``, with optimum-quanto or HQQ);
- ``values rotated``: values turned by a normalised Hadamard matrix before quantizing and back after (QuaRot,
  Ashkboos et al. 2024), which spreads a token's outlier channels over all of them;
- ``keys before RoPE``: keys quantized per channel before the rotary embedding and rotated after (KVQuant, Hooper
  et al. 2024), where a channel's range does not turn with the position; the pre-RoPE keys are ``input @ W_K + b_K``
  turned with the model's own ``rotary_emb`` (half-rotation, as Llama), checked to give back the recorded keys,
  and the variant is left out for a model where they do not;
- ``keys before RoPE, values rotated``: both;
- ``8 bits``: KIVI at 8 bits, the reference that decodes as the full cache does;
- at ``--bits 4``, three ways of spending about the same bytes on some tokens more than others (scale and zero in
  float16, so ``b + 32 / group`` bits a number; each part, quantized as its own sequence, holds its last partial key
  group exact as the store does, and the positions a store of a chosen subset needs are not charged, both in the
  split's favour): ``8/2 bits by SnapKV's score`` holds a third of the context's tokens at 8
  bits and the rest at 2 (``(8 + s) / 3 + 2 (2 + s) / 3 = 4 + s``), the third being the last ``WINDOW`` context
  tokens and the tokens before them that those queries attend to most (SnapKV's score, Li et al. 2024: softmax
  over the keys each query sees, summed over the queries, max-pooled over 7 positions, averaged over a kv head's
  query heads; ties to the earlier position), chosen per kv head from the context alone, as the suite compresses
  it before the question by default (mixed precision by importance: MiKV, Yang et al. 2024; ZipCache, He et al.
  2024); ``8/2 bits by the question's attention`` the same third chosen by the attention the question's own
  queries give the context (summed, not pooled): at ``--at question`` an optimistic choice, the error being
  measured at those same queries; at ``--at answer`` what a cache that has seen the question could do for the
  decoding steps; and ``8 bits on
  SnapKV's top, rest evicted`` keeps ``(4 + s) / (8 + s)`` of the context (53% at groups of 64) at 8 bits, chosen
  as the first, and drops the rest.

Also reported: how much of KIVI's error the five worst kv heads carry (a mixed precision that spends bits on a few
heads needs that share to be large).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from headlab.decode.instrument import MODEL
from headlab.decode.suite_instrument import check_fits, check_tasks
from headlab.errors import ConfigError
from headlab.interpret.study.base import Context, Instrument, InstrumentResult, Option, Output, Unit, at_least, register

KIND = "kv_error"
PRE_ROPE = ("keys before RoPE", "keys before RoPE, values rotated")
QUESTION = 64  # room for a task's question after its context (the suite's take up to about 50 tokens)
ANSWER = 64  # room for the answer after it (--at answer; the suite's tasks ask for at most this many tokens)
AT = ("question", "answer")
WINDOW = 32  # SnapKV's observation window: the context's last queries, which score the tokens before them
MIXED = ("8/2 bits by SnapKV's score", "8/2 bits by the question's attention", "8 bits on SnapKV's top, rest evicted")


def keys_held(k, bits: int, group: int):
    """Keys ``(B, h, t, d)`` read back as the store holds them at ``residual=0``: whole groups of ``group`` tokens
    quantized per channel (in ``k``'s dtype), the tokens of a last partial group exact (float32)."""
    import torch

    from headlab.decode import quant

    w = k.shape[2] // group * group
    if w == 0:
        return k.float()
    back = quant.dequantize_keys(*quant.quantize_keys(k[:, :, :w], bits, group), bits=bits, group=group).float()
    return torch.cat([back, k[:, :, w:].float()], 2)


def values_held(v, bits: int, group: int, rot=None):
    """Values ``(B, h, t, d)`` read back after per-token groups of ``group`` channels; ``rot``: turned by it first
    (in float32, then back to ``v``'s dtype) and back after."""
    from headlab.decode import quant

    x = v if rot is None else (v.float() @ rot).to(v.dtype)
    back = quant.dequantize_values(*quant.quantize_values(x, bits, group), bits=bits).float()
    return back if rot is None else back @ rot.T


def half_rotation(rotary, n: int):
    """``(cos, sin)`` of ``rotary`` (a transformers rotary embedding module) at positions ``0..n-1``, shaped to
    broadcast over ``(B, h, n, d)``."""
    import torch

    cos, sin = rotary(torch.zeros(1), torch.arange(n)[None])
    return cos[:, None].float(), sin[:, None].float()


def rotate_half(x):
    """Llama's half rotation: ``(x1, x2) -> (-x2, x1)`` over the two halves of the last dimension."""
    import torch

    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def _bits(value, option, options) -> None:
    if value not in (2, 4, 8):
        raise ConfigError(f"{option.label} {value}: give 2, 4 or 8 (the cache's code widths)")


def _at(value, option, options) -> None:
    if value not in AT:
        raise ConfigError(f"{option.label} {value!r}: give question or answer (whose queries the error is read at)")


def _group(value, option, options) -> None:
    at_least(2)(value, option, options)
    if value & (value - 1):
        raise ConfigError(f"{option.label} {value}: give a power of 2 (32, 64, 128), as the cache's groups are")


@register
class KVError(Instrument):
    """Relative error of each layer's attention output when the context's keys and values are quantized."""

    name = "kv-error"
    command = "kv error"
    kind = KIND
    reads_text = True
    resumable = True
    stage = "tasks"
    sharded = "it reads every head's keys and values on one process; split the tasks with torchrun instead"
    summary = """Measure, without decoding, how much each way of quantizing the KV cache changes attention's output.

Example (12 suite tasks of about 1k tokens, 4 bits in groups of 64):
headlab kv error --n 12 --tokens 1024 --seed 7 --bits 4 --group 64 --out error.json"""
    options = (
        MODEL,
        Option("n", "--n", int, 12, "tasks of the RULER-style suite (the six kinds in turn)", check=check_tasks),
        Option("tokens", "--tokens", int, 1024, "tokens per task's context", check=at_least(128)),
        Option("seed", "--seed", int, 7, "the tasks' seed", check=at_least(0)),
        Option("bits", "--bits", int, 4, "bits per number: 2, 4 or 8", check=_bits),
        Option("group", "--group", int, 64, "tokens per key group, channels per value group", check=_group),
        Option(
            "at",
            "--at",
            str,
            "question",
            "read the error at the question's queries, or at those that decode the answer (greedy, full cache)",
            check=_at,
        ),
        Option("out", "--out", Path, None, "write the result (JSON) here", short="-o", setting=False),
        Option("force", "--force", bool, False, "replace an existing --out file", setting=False),
    )
    output = Output("out", folder=False, force="force")

    def check(self, ctx: Context) -> None:
        """A task and its question must fit the model's positions (peeked before the load)."""
        self.check_positions(ctx, None)

    def check_positions(self, ctx: Context, limit: int | None) -> None:
        answer = ctx.options["at"] == "answer"
        fit = "a task, its question and its answer (--at answer)" if answer else "a task and its question"
        check_fits(
            ctx, limit, ctx.options["tokens"] + QUESTION + ANSWER * answer, f"--tokens {ctx.options['tokens']}", fit
        )

    def check_loaded(self, ctx: Context) -> None:
        from headlab.decode import suite
        from headlab.decode.heads import check_decoder
        from headlab.models.loaded_model import resolve

        self.check_positions(ctx, getattr(ctx.loaded, "max_positions", None))
        adapter = resolve(ctx.loaded)[0]
        check_decoder(adapter, getattr(ctx.loaded, "name", None) or type(adapter.model).__name__)
        d = adapter.W_V(0).shape[-1]
        if d % ctx.options["group"]:
            raise ConfigError(f"--group {ctx.options['group']}: a value group must divide the head dim {d}")
        o = ctx.options
        ctx.state["adapter"] = adapter
        ctx.state["tasks"] = suite.make_suite(ctx.loaded.tokenizer, o["n"], tokens=o["tokens"], seed=o["seed"])

    def units(self, ctx: Context) -> list[Unit]:
        return [Unit(f"task {i}", i) for i in range(len(ctx.state["tasks"]))]

    def sites(self, ctx: Context) -> list[str]:
        return [f"blocks.*.attn.{k}" for k in ("q", "k", "v", "input")]

    def unit_inputs(self, ctx: Context, unit: Unit):
        """The task's context followed by its question, as one prompt (and with ``--at answer`` the answer but its
        last token)."""
        import torch

        context, question = _ids(ctx, unit.payload)
        return torch.tensor([context + question + _answer(ctx, unit.payload)[:-1]])

    def run_unit(self, ctx: Context, unit: Unit, recording=None) -> dict:
        """``{"errors": {variant: [error per layer]}, "heads": [[KIVI's error per kv head] per layer]}``."""
        import torch

        from headlab.decode.quant import hadamard

        adapter, b, g = ctx.state["adapter"], ctx.options["bits"], ctx.options["group"]
        context, question = _ids(ctx, unit.payload)
        ctx_len, q_len = len(context), len(question)
        first = ctx_len if ctx.options["at"] == "question" else ctx_len + q_len - 1  # the queries read
        errors: dict[str, list[float]] = {}
        heads = []
        rotary = _rotary(adapter.model)
        for layer in range(adapter.n_layers):
            q, k, v = (recording[adapter.site_name(layer, s)].float() for s in ("q", "k", "v"))
            d = k.shape[-1]
            rot = hadamard(d) if d & (d - 1) == 0 else None
            k16, v16 = k.half(), v.half()
            kc, vc = k16[:, :, :ctx_len], v16[:, :, :ctx_len]
            pre = _pre_rope(adapter, layer, recording, rotary, k, ctx_len)
            variants = {
                "kivi": lambda: (keys_held(kc, b, g), values_held(vc, b, g)),
                "keys only": lambda: (keys_held(kc, b, g), vc.float()),
                "values only": lambda: (kc.float(), values_held(vc, b, g)),
                "keys g/2": lambda: (keys_held(kc, b, g // 2), values_held(vc, b, g)),
                "keys g*2": lambda: (keys_held(kc, b, g * 2), values_held(vc, b, g)),
                "keys per token": lambda: (values_held(kc, b, g), values_held(vc, b, g)),
                "8 bits": lambda: (keys_held(kc, 8, g), values_held(vc, 8, g)),
            }
            if rot is not None:
                variants["values rotated"] = lambda: (keys_held(kc, b, g), values_held(vc, b, g, rot))
            if pre is not None:
                variants["keys before RoPE"] = lambda: (pre(b, g), values_held(vc, b, g))
                if rot is not None:
                    variants["keys before RoPE, values rotated"] = lambda: (pre(b, g), values_held(vc, b, g, rot))
            keep: dict[str, torch.Tensor] = {}
            if b == 4 and ctx_len > WINDOW:
                mixed(variants, keep, q, k16, v16, ctx_len, q_len, g)
            ref = attend(q, k16.float(), v16.float(), ctx_len, first=first)
            for name, make in variants.items():
                kq, vq = make()
                kk = torch.cat([kq, k16[:, :, ctx_len:].float()], 2)
                vv = torch.cat([vq, v16[:, :, ctx_len:].float()], 2)
                o = attend(q, kk, vv, ctx_len, keep.get(name), first=first)
                errors.setdefault(name, []).append(float((o - ref).norm() / ref.norm()))
                if name == "kivi":
                    h = k.shape[1]
                    num = (o - ref).unflatten(1, (h, -1)).pow(2).sum((0, 2, 3, 4))
                    den = ref.unflatten(1, (h, -1)).pow(2).sum((0, 2, 3, 4))
                    heads.append((num / den).sqrt().tolist())
        answer = _answer(ctx, unit.payload)
        return {"errors": errors, "heads": heads, **({"answer": answer} if answer else {})}

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        import torch

        units = [values[u.key] for u in self.units(ctx)]
        names = list(units[0]["errors"])
        base = statistics.mean(e for u in units for e in u["errors"]["kivi"])
        rows = []
        for name in names:
            per = [e for u in units for e in u["errors"].get(name, [])]
            if len(per) != sum(len(u["errors"]["kivi"]) for u in units):  # left out on some task
                continue
            layers = torch.tensor([u["errors"][name] for u in units]).mean(0)
            m = statistics.mean(per)
            rows.append(
                {
                    "variant": name,
                    "rel_error": m,
                    "vs_kivi": m / base,
                    "worst_layer": float(layers.max()),
                    "worst_layer_index": int(layers.argmax()),
                }
            )
        heads = torch.tensor([u["heads"] for u in units]).mean(0)  # (layers, kv heads)
        flat, order = heads.flatten().sort(descending=True)
        worst = [[int(i) // heads.shape[1], int(i) % heads.shape[1], float(x)] for x, i in zip(flat[:5], order[:5])]
        figures = {
            "rows": rows,
            "tasks": len(units),
            "pre_rope": all(n in names for n in PRE_ROPE[:1]),
            "top5_share": float(flat[:5].sum() / flat.sum()),
            "worst_heads": worst,
            "head_error": heads.tolist(),
        }
        return InstrumentResult(KIND, model=getattr(ctx.loaded, "name", None), settings=ctx.settings, figures=figures)


def attend(q, k, v, ctx_len: int, keep=None, *, first: int | None = None):
    """Causal attention of the queries at positions ``first..n-1`` (default: ``ctx_len``) over ``k, v`` (kv heads
    shared by groups of query heads), in float32: ``(B, H, n - first, d_v)``; ``keep (h_kv, ctx_len)``: the context
    tokens each kv head still holds (default: all)."""
    import torch

    first = ctx_len if first is None else first
    rep = q.shape[1] // k.shape[1]
    n = k.shape[2]
    qq = q[:, :, first:]
    s = qq @ k.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.arange(n)[None, :] > torch.arange(first, n)[:, None]
    if keep is not None:
        gone = torch.cat([~keep, keep.new_zeros(keep.shape[0], n - ctx_len)], 1).repeat_interleave(rep, 0)
        mask = mask | gone[:, None, :]
    return s.masked_fill(mask, float("-inf")).softmax(-1) @ v.repeat_interleave(rep, 1)


def top(votes, count: int, extra: int = 0):
    """``(h_kv, len + extra)`` bool: each kv head's ``count`` highest ``votes (h_kv, len)`` (ties to the earlier
    position), and the ``extra`` positions after them."""
    import torch

    order = votes.sort(dim=-1, descending=True, stable=True).indices[:, :count]
    sel = torch.zeros(votes.shape[0], votes.shape[1] + extra, dtype=torch.bool)
    sel[:, votes.shape[1] :] = True
    return sel.scatter(1, order, True)


def split_held(kc, vc, parts):
    """Keys and values ``(1, h_kv, t, d)`` read back from ``parts``, each ``(tokens (h_kv, t) bool, bits, group)``:
    a kv head's tokens of a part, in order of position, held as :func:`keys_held` and :func:`values_held` hold a
    sequence; tokens in no part are left at 0 (evicted: mask them in :func:`attend`)."""
    import torch

    kq, vq = torch.zeros(kc.shape), torch.zeros(vc.shape)
    for h in range(kc.shape[1]):
        for tokens, bits, group in parts:
            i = tokens[h].nonzero()[:, 0]
            if len(i):
                kq[:, h, i] = keys_held(kc[:, h : h + 1, i], bits, group)[:, 0]
                vq[:, h, i] = values_held(vc[:, h : h + 1, i], bits, group)[:, 0]
    return kq, vq


def mixed(variants: dict, keep: dict, q, k16, v16, ctx_len: int, q_len: int, group: int) -> None:
    """Add the ``MIXED`` variants (at 4 bits' bytes) for a layer's queries ``q``, keys ``k16`` and values ``v16``
    (``(1, h_kv, n, d)``, float16) whose first ``ctx_len`` are the context and the next ``q_len`` the question."""
    from headlab.decode.snap_group import snap_scores

    t, third, s = ctx_len, round(ctx_len / 3), 32 / group
    kc, vc = k16[:, :, :t], v16[:, :, :t]
    votes = snap_scores(q[:, :, t - WINDOW : t], kc)[0]  # SnapKV's: max-pooled over 7, averaged over query heads
    agnostic = top(votes, max(0, third - WINDOW), WINDOW)
    oracle = top(snap_scores(q[:, :, t : t + q_len], k16[:, :, : t + q_len], pool=1)[0], third)
    kept = top(votes, max(0, round(t * (4 + s) / (8 + s)) - WINDOW), WINDOW)
    variants[MIXED[0]] = lambda: split_held(kc, vc, [(agnostic, 8, group), (~agnostic, 2, group)])
    variants[MIXED[1]] = lambda: split_held(kc, vc, [(oracle, 8, group), (~oracle, 2, group)])
    variants[MIXED[2]] = lambda: split_held(kc, vc, [(kept, 8, group)])
    keep[MIXED[2]] = kept


def _ids(ctx: Context, i: int) -> tuple[list[int], list[int]]:
    t, tok = ctx.state["tasks"][i], ctx.loaded.tokenizer
    return tok(t.context, add_special_tokens=False)["input_ids"], tok(t.question, add_special_tokens=False)["input_ids"]


def _answer(ctx: Context, i: int) -> list[int]:
    """``--at answer``: the task's answer with the full cache (greedy, the task's ``max_new_tokens`` at most,
    stopping at the model's end of sequence), decoded once and kept; ``[]`` with ``--at question``."""
    import torch

    from headlab.decode.generate import generate

    if ctx.options["at"] != "answer":
        return []
    answers = ctx.state.setdefault("answers", {})
    if i not in answers:
        context, question = _ids(ctx, i)
        n = min(ANSWER, ctx.state["tasks"][i].max_new_tokens)
        g = generate(ctx.loaded, torch.tensor([context + question]), max_new_tokens=n)
        answers[i] = g.ids[0].tolist()
    return answers[i]


def _rotary(model):
    """The model's rotary embedding module (``rotary_emb`` on the model or its base), or None."""
    for m in (model, getattr(model, "model", None), getattr(getattr(model, "model", None), "model", None)):
        if m is not None and hasattr(m, "rotary_emb"):
            return m.rotary_emb
    return None


def _pre_rope(adapter, layer: int, recording, rotary, k, ctx_len: int):
    """A maker of the context's keys quantized before RoPE and turned after (``(bits, group) -> keys``), or None
    where the keys computed from the recorded input and W_K, turned by ``rotary``, are not the recorded keys."""
    import torch

    x = recording.get(adapter.site_name(layer, "input")) if hasattr(recording, "get") else None
    if rotary is None or x is None:
        return None
    w, bias = adapter.W_K(layer).detach(), adapter.b_K(layer)  # (Hkv, E, d), (Hkv, d)
    kp = torch.einsum("ble,hed->bhld", x.float(), w.float())
    if bias is not None:
        kp = kp + bias.detach().float()[None, :, None]
    try:
        cos, sin = half_rotation(rotary, k.shape[2])
        turned = kp * cos + rotate_half(kp) * sin
    except (RuntimeError, TypeError, ValueError):
        return None
    if turned.shape != k.shape or not torch.allclose(turned, k.float(), atol=1e-3, rtol=1e-3):
        return None
    c, s = cos[:, :, :ctx_len], sin[:, :, :ctx_len]

    def make(bits: int, group: int):
        kq = keys_held(kp[:, :, :ctx_len].half(), bits, group)
        return kq * c + rotate_half(kq) * s

    return make


__all__ = ["KVError", "attend", "keys_held", "split_held", "values_held"]
