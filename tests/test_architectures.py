"""32 Hugging Face architectures, each through every step headlab offers, on tiny random-weight configs.

For each architecture of :mod:`architectures` (float32, non-trivial norms and biases), against the
model's own eager path (the yardstick, as TransformerLens compares each layer):

- ``headlab.load(folder)`` and ``adapt(model)``;
- captured patterns equal ``output_attentions`` (1e-5);
- every backend the model's attention allows gives the eager outputs (1e-4) on a right-padded batch;
  a backend that cannot apply the model's score modification is refused with a typed error;
- gates: all ones leave the output unchanged, one zero changes it;
- map-free statistics equal those of the eager maps (score modifications included);
- ``head_importance`` is finite; ``prune_heads`` equals the gated model and is physically smaller;
- ``attention_norms`` in residual mode adds up to the model's own residual stream, and its norms equal
  the norms of those vectors; attention mode equals Kobayashi et al.'s definition from the eager maps;
- ``rollout`` equals Abnar and Zuidema's definition from the eager maps.

Architectures headlab refuses are refused with a typed error naming the reason, on load and on adapt.
"""

from __future__ import annotations

import pytest
import torch

import headlab
from headlab.attention import backends as hb
from headlab.errors import BackendUnsupportedError, HeadlabError, UnsupportedArchitectureError
from headlab.models import adapt
from headlab.models.hf import REFUSED
from headlab.models.hf.own_state import bridge_of

import architectures as A
from conftest import refusal_check

SUPPORTED = [pytest.param(n, marks=pytest.mark.slow) if n in A.SLOW else n for n in A.NAMES if n not in REFUSED]
# types found by structure whose q/k norm spans every head (physical removal is refused; gates work)
CROSS_HEAD_NORMS = {"olmoe", "olmo3", "olmo_hybrid"}
# types whose attention module reads its head count or holds per-head parameters headlab does not slice (MPT's own
# math with ALiBi slopes, MPNet's relative bias; wav2vec2-conformer's relative-position pos_bias_u/v): physical
# removal is refused, typed, with the reason; gates work
OWN_HEAD_COUNT = {"mpt", "mpnet", "wav2vec2-conformer", "deberta-v2"}
# types whose padding mask is a finite additive -10000 (not -inf): read as a bias, as eager adds it, so on a padded
# batch torch's SDPA (no score_mod) is refused, typed
FINITE_MASK = {"markuplm"}
BACKENDS = ["reference", "sdpa", "tiled", "sparse"]


def _main(out) -> torch.Tensor:
    lg = getattr(out, "logits", None)
    return lg if lg is not None else out.last_hidden_state


def _real(t: torch.Tensor, x: dict, dim: int) -> torch.Tensor:
    """``t`` at real (unpadded) query positions only, flattened (batch first, positions on ``dim``). A padding
    query that sees no key under a sliding window is a zero row in headlab (the rule for fully masked rows)
    and a uniform row in eager attention; neither means anything."""
    m = x.get("attention_mask")
    if m is None or t.shape[dim] != m.shape[1]:
        return t
    keep = m.bool()
    return t.movedim(dim, 1)[keep]


def _eager_maps(a, eager) -> list[torch.Tensor]:
    """The eager maps of every attention layer, in the adapter's order (encoder-decoders: encoder self,
    decoder self, then cross-attention)."""
    if "encoder" not in a.stacks:
        return list(eager.attentions)
    return [*eager.encoder_attentions, *eager.decoder_attentions, *eager.cross_attentions]


def _score_mod(model) -> bool:
    """Does the model change its scores beyond the scale (soft-capping, ALiBi)?"""
    cfg = model.config
    found = getattr(adapt(model), "found", None)  # a type found by structure: a bias passed in the mask, T5's bias
    if found is not None and ({"mask_bias", "position_bias"} & set(found.kwargs)):
        return True
    mods = ("bloom", "t5", *FINITE_MASK)
    return bool(getattr(cfg, "attn_logit_softcapping", None)) or cfg.model_type in mods or bool(
        getattr(cfg, "alibi", False))


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = A.build(name)
        return cache[name]
    return get


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_architectures_say_why(name, built, tmp_path, sweep):
    model = built(name)
    says = f"no headlab adapter for '{model.config.model_type}': "
    with pytest.raises(UnsupportedArchitectureError, match=says) as e:
        adapt(model)
    sweep(name, "refused", "declared: " + refusal_check(str(e.value)))
    model.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match=REFUSED[name].split(";")[0][:40]):
        headlab.load(tmp_path)


@pytest.mark.parametrize("name", SUPPORTED)
def test_every_step(name, built, tmp_path, sweep):
    model = built(name)
    x = A.inputs(name)
    with torch.no_grad():
        eager = model(**x, output_attentions=True)
    ref = _main(eager)
    a = adapt(model)
    L = a.n_layers
    how = (("own math, " if bridge_of(model) is not None else "") + "by structure") if getattr(
        a, "by_structure", False) else f"family '{a.family}'"
    served = [f"{how}, {A.BUILDERS[name][1]} inputs"]

    def caveat(what: str = "") -> None:  # what the table says for this type; a failure below replaces it
        served.extend([what] if what else [])
        sweep(name, "served", "; ".join(served))
    caveat()

    # load from a folder
    model.save_pretrained(tmp_path)
    loaded = headlab.load(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(_main(loaded.model(**x)), ref, atol=1e-5, rtol=1e-5)
    assert loaded.adapter.n_layers == L and loaded.family == a.family

    # capture equals output_attentions (self- and cross-attention), under the adapter's site names
    emaps = _eager_maps(a, eager)
    assert len(emaps) == L
    cache = headlab.capture(model, x, a.sites("pattern"))
    for layer in range(L):
        torch.testing.assert_close(_real(cache[a.site_name(layer, "pattern")], x, 2),
                                   _real(emaps[layer], x, 2), atol=1e-5, rtol=1e-5)
    if "encoder" in a.stacks:
        assert {"encoder.0.attn.pattern", "decoder.0.attn.pattern", "decoder.1.cross.pattern"} <= set(cache)

    # every backend the attention allows
    for backend in BACKENDS:
        if backend == "sdpa" and _score_mod(model):
            with pytest.raises(BackendUnsupportedError), torch.no_grad(), a.use_backend(backend):
                model(**x)
            caveat("sdpa refused: a score modification")
            continue
        with torch.no_grad(), a.use_backend(backend):
            got = _main(model(**x))
        torch.testing.assert_close(_real(got, x, 1), _real(ref, x, 1), atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"{backend}: {m}")

    # gates
    with torch.no_grad():
        torch.testing.assert_close(_main(model(**x)), ref, atol=1e-5, rtol=1e-5)
        a.gates[L - 1, 1] = 0.0
        gated = _main(model(**x))
        assert (gated - ref).abs().max() > 1e-4
        # a zero gate equals zeroing the head's block of W^O (ALBERT: that block serves every layer)
        a.reset_gates()
        if a.shared_layers:
            a.gates[:, 1] = 0.0
            gated = _main(model(**x))
            a.reset_gates()
        wo = a.W_O(L - 1)
        saved = wo[1].detach().clone()
        with torch.no_grad():
            wo[1] = 0.0
        zeroed = _main(model(**x))
        with torch.no_grad():
            wo[1] = saved
        torch.testing.assert_close(gated, zeroed, atol=1e-5, rtol=1e-5)

    # map-free statistics equal the eager maps'
    st = headlab.capture(model, x, a.sites("stats"))
    for layer in range(L):
        p = emaps[layer].double()
        s = st[a.site_name(layer, "stats")]
        ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
        torch.testing.assert_close(_real(s.entropy.double(), x, 2), _real(ent, x, 2), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(_real(s.max_weight.double(), x, 2), _real(p.amax(-1), x, 2), atol=1e-5, rtol=1e-5)

    # importance, pruning
    one = {k: v[:1] for k, v in x.items()}
    text_only = set(one) == {"input_ids", "attention_mask"}
    examples = [one["input_ids"][0]] if text_only else [one, {k: v[1:] for k, v in x.items()}]
    imp = headlab.head_importance(model, examples, batch_size=2)
    assert imp.shape == (L, a.n_heads) and torch.isfinite(imp).all() and (imp > 0).any()
    G = a.n_heads // a.n_kv_heads
    drop = {0: list(range(G))} if 1 < G < a.n_heads else {0: [1]}  # a whole kv group, or one head
    for group in a.shared_layers:  # ALBERT: the same heads in every layer that shares the weights
        if 0 in group:
            drop = {l: drop[0] for l in group}
    if name in CROSS_HEAD_NORMS:  # a q/k norm across all heads: removal refused, with the reason
        with pytest.raises(HeadlabError, match="normalises all heads"):
            headlab.prune_heads(model, drop)
        drop = {}
        caveat("pruning refused: a q/k norm spans all heads")
    if name in OWN_HEAD_COUNT:  # it reads the head count: removal refused, with the reason
        with pytest.raises(HeadlabError, match="reads a head count or width headlab cannot change"):
            headlab.prune_heads(model, drop)
        drop = {}
        caveat("pruning refused: it reads a head count headlab cannot change")
    p = headlab.prune_heads(model, drop) if drop else None
    if p is None:
        _check_norms_and_rollout(model, a, x)
        return
    for l, hs in drop.items():
        a.gates[l, hs] = 0.0
    with torch.no_grad():
        gated = _main(model(**x))
        pruned = _main(p.model(**x))
    a.reset_gates()
    torch.testing.assert_close(_real(pruned, x, 1), _real(gated, x, 1), atol=1e-4, rtol=1e-4)
    assert p.adapter.layer_heads[0] == a.n_heads - len(drop[0])
    if a.shared_layers:  # pruning one layer of a shared block alone is refused, with the reason
        with pytest.raises(HeadlabError, match="shares its attention module"):
            headlab.prune_heads(model, {0: [1]})
    assert sum(t.numel() for t in p.model.parameters()) < sum(t.numel() for t in model.parameters())
    _check_norms_and_rollout(model, a, x)


def _check_norms_and_rollout(model, a, x):
    """Norms and rollout, on one unpadded sequence."""
    seq = {k: v[:1] for k, v in x.items()}
    if "attention_mask" in seq:
        seq["attention_mask"] = torch.ones_like(seq["attention_mask"])
    _check_norms(model, a, seq)
    if getattr(a, "chain_refusal", ""):  # a hybrid whose other blocks mix tokens: rollout refused, with the reason
        with pytest.raises(UnsupportedArchitectureError, match="mix tokens without an attention map"):
            headlab.rollout(model, seq)
        return
    with torch.no_grad():
        maps = _eager_maps(a, model(**seq, output_attentions=True))
    for stack, layers in a.stacks.items():  # Abnar and Zuidema within each stack that chains
        if stack == "cross":
            continue
        ro = headlab.rollout(model, seq, stack=None if len(a.stacks) == 1 else stack)
        n = maps[layers[0]].shape[-1]
        eye = torch.eye(n, dtype=torch.float64)
        R = None
        for layer in layers:
            Ah = 0.5 * maps[layer][0].double().mean(0) + 0.5 * eye
            Ah = Ah / Ah.sum(-1, keepdim=True)
            R = Ah if R is None else Ah @ R
        torch.testing.assert_close(ro.maps[-1].double(), R, atol=1e-5, rtol=1e-5)


def _check_norms(model, a, seq):
    """Residual mode: the vectors F_i(x_j) built here from the recorded tensors add up to the stream the model
    computes, and their norms are what attention_norms reports; attention mode: ||sum_h alpha f_h(x_j)||."""
    L = a.n_layers
    rec: dict = {}
    handles = []
    no_layout = "norms" in getattr(a, "limits", {}) and getattr(a, "found", None) is not None
    for l in range(L):
        cross = "cross" in a.stacks and l in a.stacks["cross"]
        bn = None if cross or no_layout else a.attention_norm(l)

        class D(dict):  # records only while layer l is being computed (ALBERT's modules serve every layer)
            def __setitem__(self, key, value, l=l):
                if a.attn_modules[l]._headlab is a.states[l]:
                    super().__setitem__(key, value)
        d = rec[l] = D()

        def pre_attn(m, args, kwargs, d=d, l=l):
            d["x"] = a.value_input(l, args, kwargs).detach()[0].clone()

        def out_hook(m, args, out, d=d):
            d["o"] = out.detach()[0].clone()
        handles.append(a.attn_modules[l].register_forward_pre_hook(pre_attn, with_kwargs=True))
        handles.append(a.out_projs[l].register_forward_hook(out_hook))
        if bn is not None and bn.pre is not None:
            handles.append(bn.pre.register_forward_pre_hook(lambda m, args, d=d: d.__setitem__("stream", args[0].detach()[0].clone())))
        if bn is not None and bn.post is not None:
            handles.append(bn.post.register_forward_hook(lambda m, args, out, d=d: d.__setitem__("post_out", out.detach()[0].clone())))
            handles.append(bn.post.register_forward_pre_hook(lambda m, args, d=d: d.__setitem__("post_in", args[0].detach()[0].clone())))
        if bn is not None and bn.parallel is not None:
            handles.append(bn.parallel.register_forward_hook(
                lambda m, args, out, d=d: d.__setitem__("par", (out[0] if isinstance(out, tuple) else out).detach()[0].clone())))
    try:
        with torch.no_grad():
            maps = _eager_maps(a, model(**seq, output_attentions=True))
    finally:
        for h in handles:
            h.remove()
    selfs = [l for l in range(L) if "cross" not in a.stacks or l not in a.stacks["cross"]]
    if "norms" in getattr(a, "limits", {}) and getattr(a, "found", None) is not None:
        # a layout structure could not identify (a scaled residual branch, LayerScale): residual mode refused
        # with the reason, attention mode served
        with pytest.raises(HeadlabError, match="residual-mode norms are not available"):
            headlab.attention_norms(model, seq, mode="residual")
        selfs = []
        res = None
    else:
        res = headlab.attention_norms(model, seq, mode="residual", layers=selfs)
    att = headlab.attention_norms(model, seq, mode="attention")
    if 0 < len(selfs) < L:  # cross-attention: no residual decomposition; the self layers answer, with a note
        whole = headlab.attention_norms(model, seq, mode="residual")
        assert whole.layers == selfs and any("cross-attention" in n for n in whole.notes)
        with pytest.raises(HeadlabError, match="cross-attention"):  # asked for by index: refused with the reason
            headlab.attention_norms(model, seq, mode="residual", layers=[L - 1])
    for l in range(L):
        d = rec[l]
        P = maps[l][0].double()  # (H, n, n)
        x = d["x"].double()
        n = P.shape[1]  # queries (the keys are x's rows)
        WV, WO = a.W_V(l).detach().double(), a.W_O(l).detach().double()
        v = torch.einsum("ne,ked->knd", x, WV)
        if a.b_V(l) is not None:
            v = v + a.b_V(l).detach().double().unsqueeze(1)
        f = torch.einsum("hnd,hde->hne", v.repeat_interleave(a.n_heads // a.n_kv_heads, 0), WO)  # (H, n, E)
        mix = torch.einsum("hij,hje->ije", P, f)  # (i, j, E): sum_h alpha f_h(x_j)
        torch.testing.assert_close(mix.norm(dim=-1), att.layer[l].double(), atol=1e-5, rtol=1e-4)
        bO = a.b_O(l)
        bO = torch.zeros(x.shape[1], dtype=torch.float64) if bO is None else bO.detach().double()
        torch.testing.assert_close(mix.sum(1) + bO, d["o"].double(), atol=1e-5, rtol=1e-4)  # what W^O wrote
        if l not in selfs:
            continue
        bn = a.attention_norm(l)
        mix, bO, o = bn.branch(mix), bn.branch(bO), bn.branch(d["o"].double())  # a scaled branch (LayerScale)
        stream = d.get("stream", x).double()
        eye = torch.eye(n, dtype=torch.float64).unsqueeze(-1)
        if bn.post is not None:
            z = d["post_in"].double()
            zc = z - z.mean(-1, keepdim=True) if bn.kind == "layernorm" else z
            var = (zc * zc).mean(-1)
            s = torch.sqrt(var + bn.eps()).view(n, 1, 1)
            gamma = bn.scale(torch.float64)

            def g(u):
                u = u - u.mean(-1, keepdim=True) if bn.kind == "layernorm" else u
                return u * gamma / s
            if bn.post_reads == "sum":
                F = g(mix + eye * x.unsqueeze(0))
            else:
                F = g(mix) + eye * stream.unsqueeze(0)
            torch.testing.assert_close(F.sum(1) + g(bO.view(1, 1, -1).expand(n, 1, -1))[:, 0]
                                       + (bn.post.bias.detach().double() if getattr(bn.post, "bias", None) is not None else 0),
                                       (d["post_out"].double() + (stream if bn.post_reads == "branch" else 0)),
                                       atol=1e-4, rtol=1e-4)
        else:
            r = stream + (d["par"].double() if bn.parallel is not None else 0)
            F = mix + eye * r.unsqueeze(0)
            total = o + stream + (d["par"].double() if bn.parallel is not None else 0)
            torch.testing.assert_close(F.sum(1) + bO, total, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(F.norm(dim=-1), res.layer[l].double(), atol=1e-5, rtol=1e-4)


def test_support_table_in_the_docs_is_the_registry():
    """docs/models.md holds the table generated from the registered families (regenerate it when this fails:
    replace the block between the support-table markers with ``support_markdown()``)."""
    from pathlib import Path

    from headlab.models.hf.support import support_markdown

    page = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    block = page.split("<!-- support-table:start -->\n", 1)[1].split("<!-- support-table:end -->", 1)[0]
    assert block == support_markdown()


def test_a_module_that_is_no_transformers_model_is_refused_with_what_is_served():
    from headlab.models.hf import unsupported_message

    msg = unsupported_message("MyNet")
    assert "adapted by structure" in msg and "adding-a-family.md" in msg
    with pytest.raises(UnsupportedArchitectureError, match="'Linear'"):
        adapt(torch.nn.Linear(2, 2))


def test_the_support_table_lists_the_types_the_suite_verifies_by_structure():
    from headlab.models.hf.support import STRUCTURE_LIMITS, VERIFIED_BY_STRUCTURE

    assert list(VERIFIED_BY_STRUCTURE) == A.STRUCTURE
    assert set(STRUCTURE_LIMITS) <= set(VERIFIED_BY_STRUCTURE) and CROSS_HEAD_NORMS <= set(STRUCTURE_LIMITS)


def test_ablation_of_an_encoder_decoder_head_is_its_kl_effect(built):
    """Ablation through the stacked sites: zeroing a cross-attention head (and an encoder head) of T5 changes
    the decoder's distribution by exactly the KL that gating the head by hand gives."""
    import torch.nn.functional as F

    model = built("t5")
    a = adapt(model)
    x = A.inputs("t5", padded=False)
    examples = [{k: v[i:i + 1] for k, v in x.items()} for i in range(2)]
    cross = a.stacks["cross"][-1]
    r = headlab.ablate(model, examples, heads=[(0, 1), (cross, 2)], k=2, keep_one=False, n_boot=50, cka=False,
                       loss="kl")
    with torch.no_grad():
        p0 = F.log_softmax(model(**x).logits.double(), -1)
        for layer, head in ((0, 1), (cross, 2)):
            a.gates[layer, head] = 0.0
            p = F.log_softmax(model(**x).logits.double(), -1)
            a.reset_gates()
            kl = (p0.exp() * (p0 - p)).sum(-1).mean(-1).mean()  # per decoder token, per example, then mean
            assert float(r.single[layer, head]) == pytest.approx(float(kl), rel=1e-4, abs=1e-9)
            assert float(kl) > 0
