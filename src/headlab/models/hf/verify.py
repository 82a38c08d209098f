"""The load-time check: headlab's view of a model against the model's own eager attention, on its weights.

:func:`verify` runs a few tokens (:func:`headlab.models.inputs.example_inputs`) through the model and checks,
for every attention layer:

============  ================================================================================================
check         what must hold
============  ================================================================================================
pattern       the pattern headlab captures equals the eager ``output_attentions`` maps
output        the model's output through headlab's attention equals its eager output
values        the values the attention reads equal ``x W_V[h] + b_V[h]`` from the adapter's per-head weights
              (through the declared or found per-head value norm, where the values pass through one)
heads         the per-head outputs ``z_h W_O[h]`` plus ``b_O`` add up to what W^O writes
gate          a zero gate on a head equals zeroing that head's block of W^O (and changes the output)
residual      the block's stream follows the norm layout found (pre, post, sandwich or parallel)
============  ================================================================================================

Each check is a :class:`~headlab.models.hf.verdict.Check`, all of them a :class:`~headlab.models.hf.verdict.Verdict`.
A model adapted by structure is served only when every check passes
(:func:`~headlab.models.hf.structure.adapt_by_structure`); the verdict is cached per config, in memory and
under headlab's cache folder. ``headlab models --check PATH`` prints each check for any model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headlab.models.hf.own_bridge import bridge_of, rebuilt
from headlab.models.hf.trace import close, continues_from, implementation, mark_norms, recording
from headlab.models.hf.verdict import Check, Verdict
from headlab.models.inputs import example_inputs

CHECKS = ("pattern", "output", "values", "heads", "gate", "residual")


_VERDICTS: dict[str, Verdict] = {}


def config_key(model: Any) -> str:  # a transformers model
    """A stable key of a model's architecture: its class and config (what a verdict is cached under)."""
    import transformers

    from headlab._version import __version__

    cfg = model.config.to_dict()
    for k in (
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_attn_implementation",
        "_attn_implementation_internal",
        "architectures",
    ):
        cfg.pop(k, None)
    # which vectors are exactly zero: a fresh config's zero-initialised extra bias (DeBERTa's v_bias) reads as a plain
    # projection, a trained one does not, so the two must not share a discovery or a verdict
    zeros = sorted(n for n, p in model.named_parameters() if p.dim() <= 1 and not bool(p.detach().any()))
    # and which are exactly one: a fresh LayerScale (all ones) hides the scale a trained one shows
    ones = sorted(n for n, p in model.named_parameters() if p.dim() == 1 and bool((p.detach() == 1).all()))
    # and the module tree itself: the same config with another attention module (remote code, a patched model)
    tree = hashlib.sha1(
        repr(
            [(n, type(m).__name__) for n, m in model.named_modules()]
            + [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        ).encode()
    ).hexdigest()
    blob = json.dumps(
        [type(model).__name__, cfg, transformers.__version__, __version__, zeros, ones, tree],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _source_hash() -> str:
    here = Path(__file__).resolve().parent
    h = hashlib.sha1()
    for name in (
        "structure.py",
        "layout.py",
        "trace.py",
        "verify.py",
        "verdict.py",
        "attention_fn.py",
        "family.py",
        "own_math.py",
        "own_state.py",
        "own_bridge.py",
        "found_ops.py",
        "variants.py",
        "hybrid.py",
    ):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:12]


def _key(adapter) -> str:
    """The verdict's cache key: the model's config and the view checked (its declared or found layout)."""
    view = repr(
        [type(adapter).__name__]
        + [
            getattr(adapter, n, None)
            for n in (
                "projections",
                "out",
                "norms",
                "head_attrs",
                "layers",
                "attention",
                "decoder_out",
                "cross_out",
                "decoder_norms",
            )
        ]
    )
    return config_key(adapter.model) + "-" + hashlib.sha1(view.encode()).hexdigest()[:8]


def _disk(key: str) -> Path:
    from headlab.models.cache import cache_dir

    return cache_dir("verdicts", f"{key}-{_source_hash()}.json")


def _main(out) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor):
            return t
    return out[0] if isinstance(out, tuple | list) else out


def _eager_maps(adapter, out) -> list[torch.Tensor] | None:
    if set(adapter.stacks) == {"encoder", "decoder", "cross"}:
        parts = [getattr(out, n, None) for n in ("encoder_attentions", "decoder_attentions", "cross_attentions")]
        return None if any(p is None for p in parts) else [m for p in parts if p is not None for m in p]
    maps = getattr(out, "attentions", None)
    return None if maps is None else list(maps)


def verify(adapter, inputs: dict | None = None, *, cache: bool = True) -> Verdict:
    """Check ``adapter``'s view of its model against the model's eager attention (see the module docstring).

    Args:
        adapter: an :class:`~headlab.models.hf.family.HFAdapter` (declared or found by structure).
        inputs: the batch to check on (default: :func:`~headlab.models.inputs.example_inputs`, 8 tokens).
        cache: reuse (and store) the verdict of the same config.
    """
    model = adapter.model
    key = _key(adapter)
    if cache and inputs is None:
        hit = _VERDICTS.get(key)
        if hit is None:
            try:
                hit = Verdict.from_json(json.loads(_disk(key).read_text()))
                hit.cached = True
            except (OSError, ValueError, TypeError, KeyError):
                hit = None
        if hit is not None:
            _VERDICTS[key] = hit
            return hit
    t0 = time.perf_counter()
    x = inputs if inputs is not None else example_inputs(model, tokens=8)
    verdict = Verdict(
        model_type=str(getattr(model.config, "model_type", "?")),
        family=adapter.family,
        by_structure=bool(getattr(adapter, "by_structure", False)),
    )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                view = getattr(adapter, "checked_view", None)  # a LoRA model: checked on its effective weights
                with view(x, verdict) if view is not None else contextlib.nullcontext():
                    _run_checks(adapter, x, verdict)
            except Exception as e:  # noqa: BLE001  (a check that cannot even run has failed)
                done = {c.name for c in verdict.checks}
                name = next((c for c in CHECKS if c not in done), "run")
                verdict.checks.append(
                    Check(
                        name,
                        False,
                        float("inf"),
                        _tol(model),
                        f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                    )
                )
    finally:
        model.train(was_training)
        adapter.reset_gates()
    verdict.seconds = time.perf_counter() - t0
    if cache and inputs is None:
        _VERDICTS[key] = verdict
        with contextlib.suppress(OSError):
            path = _disk(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(verdict.to_json()))
    return verdict


def _tol(model) -> float:
    p = next(model.parameters(), None)
    return 1e-4 if p is None or p.dtype in (torch.float32, torch.float64) else 2e-2


def _worst(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max()))) if a.numel() else 0.0


def _run_checks(adapter, x: dict, verdict: Verdict) -> None:
    model = adapter.model
    tol = _tol(model)
    L = adapter.n_layers
    add = verdict.checks.append

    plan = _residual_plan(adapter)  # the residual check records the eager run's stream
    with recording({} if isinstance(plan, Check) else plan[2]) as stream, implementation(model, "eager"):
        eager = model(**x, output_attentions=True)
    ref = _main(eager).detach()
    emaps = _eager_maps(adapter, eager)

    # one run through headlab's attention, recording the pattern, the values, z, head_out and what W^O wrote
    got: dict[str, torch.Tensor] = {}

    def keep(t, site):
        got[site] = t.detach()
        return t

    vin: dict[int, torch.Tensor] = {}
    wo_out: dict[int, torch.Tensor] = {}
    handles = []
    for l in range(L):

        def pre(m, args, kwargs, l=l):
            if getattr(m, "_headlab", None) is adapter.states[l]:
                t = adapter.value_input(l, args, kwargs)
                if isinstance(t, torch.Tensor):
                    vin[l] = t.detach()

        handles.append(adapter.attn_modules[l].register_forward_pre_hook(pre, with_kwargs=True))

        def post(m, args, out, l=l):
            if getattr(m, "_headlab", None) is adapter.states[l]:  # a W^O shared by layers (ALBERT): this layer's call
                wo_out[l] = out.detach()

        handles.append(adapter.out_projs[l].register_forward_hook(post))
    sites = {f"{p}.{kind}": keep for p in adapter.site_prefixes for kind in ("pattern", "v", "head_out")}
    try:
        with adapter.hooks(sites):
            out = _main(model(**x)).detach()
    finally:
        for h in handles:
            h.remove()

    # pattern
    if emaps is None and bridge_of(model) is not None:  # a model without output_attentions: z rebuilt from P and v
        add(Check("pattern", *rebuilt(adapter, x, got, tol)))
    elif emaps is None or len(emaps) != L:
        add(
            Check(
                "pattern",
                False,
                detail=f"the eager model returned {0 if emaps is None else len(emaps)} attention "
                f"maps for {L} attention layers",
            )
        )
    else:
        worst, where = 0.0, ""
        for l in range(L):
            mine = got.get(adapter.site_name(l, "pattern"))
            if mine is None or mine.shape != emaps[l].shape:
                worst, where = (
                    float("inf"),
                    f"layer {l}: shape {None if mine is None else tuple(mine.shape)} vs {tuple(emaps[l].shape)}",
                )
                break
            w = float((mine.double() - emaps[l].double()).abs().max())
            if w > worst:
                worst, where = w, f"worst at {adapter.site_name(l, 'pattern')}"
        add(Check("pattern", worst <= tol, worst, tol, where))
    # output
    w = _worst(out, ref) if out.shape == ref.shape else float("inf")
    add(Check("output", w <= tol, w, tol, "the model's output through headlab's attention against eager"))
    # values: x W_V + b_V
    worst, where = 0.0, ""
    for l in range(L):
        v = got.get(adapter.site_name(l, "v"))
        xin = vin.get(l)
        if v is None or xin is None:
            worst, where = float("inf"), f"layer {l}: the values or their input were not seen"
            break
        vnorm = adapter.value_norm_module(l) if getattr(adapter, "value_norm", None) else None
        WV, b = adapter.value_projection(l) if vnorm is not None else (adapter.W_V(l), adapter.b_V(l))
        mine = torch.einsum("ble,hed->bhld", xin.double(), WV.detach().double())  # WV: (Hkv, E, d)
        if b is not None:
            mine = mine + b.detach().double().unsqueeze(1)
        if vnorm is not None:  # values through a per-head value norm: norm(x W_V + b_V), each head's d features
            mine = vnorm(mine.to(v.dtype)).double()
        ww = _worst(mine, v) if mine.shape == v.shape else float("inf")
        if ww > worst:
            worst, where = ww, f"layer {l}: x W_V + b_V against the values the attention reads"
    add(Check("values", worst <= tol, worst, tol, where or "x W_V + b_V equals the values the attention reads"))
    # heads: sum_h head_out + b_O = what W^O wrote
    worst, where = 0.0, ""
    for l in range(L):
        ho = got.get(adapter.site_name(l, "head_out"))
        if ho is None or l not in wo_out:
            worst, where = float("inf"), f"layer {l}: head_out or W^O's output was not seen"
            break
        s = ho.double().sum(-3)
        b = adapter.b_O(l)
        if b is not None:
            s = s + b.detach().double()
        ww = _worst(s, wo_out[l]) if s.shape == wo_out[l].shape else float("inf")
        if ww > worst:
            worst, where = ww, f"layer {l}: sum of z_h W_O[h] + b_O against W^O's output"
    add(Check("heads", worst <= tol, worst, tol, where or "per-head outputs add up to W^O's output"))
    # gate: a zero gate = a zeroed block of W^O, and it changes the output
    l = L - 1
    h = min(1, adapter.layer_heads[l] - 1)
    group = next((g for g in adapter.shared_layers if l in g), [l])  # a W^O block shared by layers (ALBERT)
    with implementation(model, "eager"):
        adapter.gates[group, h] = 0.0
        gated = _main(model(**x)).detach()
        adapter.reset_gates()
        wo = adapter.W_O(l)
        saved = wo[h].detach().clone()
        try:
            wo[h] = 0.0
            zeroed = _main(model(**x)).detach()
        finally:
            wo[h] = saved
    w = _worst(gated, zeroed)
    moved = _worst(gated, ref)
    ok = w <= tol and moved > 0
    add(
        Check(
            "gate",
            ok,
            w,
            tol,
            f"gate of head {h} in layer {l} against its zeroed W^O block"
            + ("" if moved > 0 else "; the zero gate changed nothing"),
        )
    )
    # residual: the block's stream follows the layout found
    add(_residual(adapter, plan, stream, tol))


def _residual_plan(adapter):
    """What the residual check records: ``(layouts, skipped, named)``, or a :class:`Check` when there is
    nothing to hold against the stream."""
    from headlab.errors import HeadlabError

    blocks = getattr(adapter, "blocks", None)
    if blocks is None:
        return Check("residual", True, detail="no blocks to check")
    if adapter.shared_layers:
        return Check("residual", True, detail="layers share one block: checked by the family's tests")
    layouts = {}
    skipped = []
    for l in range(adapter.n_layers):
        try:
            layouts[l] = adapter.attention_norm(l)
        except HeadlabError as e:
            skipped.append((l, str(e)))
    if not layouts:
        why = skipped[0][1] if skipped else ""
        return Check("residual", True, detail=f"residual-mode norms unavailable ({why})")
    named: dict[str, nn.Module] = {}
    for l in layouts:
        for n, m in blocks[l].named_modules():
            named[f"{l}/{n}"] = m
        named[f"{l}/@attn"] = adapter.attn_modules[l]
        named[f"{l}/@out"] = adapter.out_projs[l]
    return layouts, skipped, named


def _residual(adapter, plan, rec: dict, tol: float) -> Check:
    """The norm layout of every block that has one, held against the stream recorded by the eager run."""
    if isinstance(plan, Check):
        return plan
    layouts, skipped, named = plan
    for l, bn in layouts.items():
        mine = {k[len(f"{l}/") :]: v for k, v in rec.items() if k.startswith(f"{l}/")}
        xb, out = mine.get("", (None, None))
        a_in = mine.get("@attn", (None, None))[0]
        o = mine.get("@out", (None, None))[1]
        if xb is None or a_in is None or o is None:
            return Check("residual", False, float("inf"), tol, f"layer {l}: the block's stream was not seen")
        o = bn.branch(o)  # a scaled residual branch (LayerScale, a residual multiplier): what the block reads
        names = {id(m): n[len(f"{l}/") :] for n, m in named.items() if n.startswith(f"{l}/") and "/@" not in n}
        attn_name = names.get(id(adapter.attn_modules[l]), "@attn")
        out_name = names.get(id(adapter.out_projs[l]), "@out")

        def io(m):
            return mine.get(names.get(id(m)), (None, None))

        def inside(n):
            return n in ("@attn", "@out", out_name) or n == attn_name or n.startswith(f"{attn_name}.")

        marked = mark_norms(
            {n: v for n, v in mine.items() if not inside(n) or n in (out_name, "@out")},
            {
                n: m
                for n, m in ((k[len(f"{l}/") :], v) for k, v in named.items() if k.startswith(f"{l}/"))
                if not inside(n)
            },
        )
        skip = lambda n: n in (out_name, "@out")
        failures = []
        if bn.pre is not None:
            if not close(io(bn.pre)[1], a_in, tol):
                failures.append("the pre norm's output is not the attention's input")
        elif not close(a_in, xb, tol):
            failures.append("the attention does not read the block's input")
        if bn.post is not None:
            want = o if bn.post_reads == "branch" else xb + o
            p_in, p_out = io(bn.post)
            if not close(p_in, want, tol):
                failures.append(
                    f"the post norm does not read {'Attn(x)' if bn.post_reads == 'branch' else 'x + Attn(x)'}"
                )
            elif bn.post_reads == "sum" and not continues_from(p_out, marked, skip=skip, atol=tol):
                failures.append(
                    "the stream does not go on from the post norm's output (a pre norm of the next sublayer?)"
                )
            elif bn.post_reads == "branch" and not continues_from(xb + p_out, marked, skip=skip, atol=tol):
                failures.append("the stream does not go on from x + post(Attn(x))")
        elif bn.parallel is not None:
            par = io(bn.parallel)[1]
            if par is None or out is None or not close(out, xb + o + par, tol):
                failures.append("the block's output is not x + Attn(x) + the parallel module's output")
        elif not continues_from(xb + o, marked, skip=skip, atol=tol):
            failures.append("the stream does not go on from x + Attn(x)")
        if failures:
            return Check("residual", False, float("nan"), tol, f"layer {l} ({bn.layout} layout): {failures[0]}")
    detail = f"{len(layouts)} blocks follow their layout"
    if skipped:
        detail += f"; {len(skipped)} layers have none ({skipped[0][1][:80]})"
    return Check("residual", True, 0.0, tol, detail)


__all__ = ["CHECKS", "verify"]
