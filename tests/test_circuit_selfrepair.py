"""Self-repair (headlab.interpret.circuits.selfrepair), each number against an independent computation.

- total effect against :func:`headlab.patch`'s node effect on ``z`` (raw), direct effect against
  :func:`~headlab.interpret.circuits.edge_patch`'s score of ``a{l}.h{h}->logits``; self_repair = total - direct
  (Rushing and Nanda's sign: opposite to direct when downstream repairs);
- every number (total, direct, each downstream component's compensation, the pair ablation) recomputed by hand with
  plain torch hooks on the model's own modules (the z entering W^O, the MLPs' outputs, ``ln_f`` and the tied
  unembedding), for the patch, mean and zero ablations;
- a planted backup head: hand-set weights where head 1.0 copies head 0.0's answer into the logits only when 0.0's
  output is missing (it attends away from the answer when 0.0's write is in its query);
- the verdict rules on constructed numbers; typed errors before any forward; the result's file and table.
"""

from __future__ import annotations

import math

import pytest
import torch

import headlab
from headlab.errors import ConfigError, InputError
from headlab.interpret.circuits import edge_patch
from headlab.interpret.circuits.selfrepair import KIND, Rules, SelfRepair, compensators, downstream, judge, self_repair
from headlab.interpret.circuits.graph import graph
from headlab.interpret.patching import logit_diff
from headlab.models.transformer import Transformer, TransformerConfig
from headlab.results import Result

CLEAN = torch.tensor([[1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8]])
CORRUPT = torch.tensor([[1, 9, 3, 4, 5, 6], [3, 11, 5, 6, 7, 8]])
METRIC = logit_diff(2, 5)


def tiny(seed=0, layers=3):
    torch.manual_seed(seed)
    m = Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=layers, n_heads=4, causal=True)).eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so that heads matter and the norms bend
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
    return m.double()


# ---- an independent computation: plain torch hooks on the model's own modules --------------------------------

def _ld(logits):
    return (logits[:, -1, 2] - logits[:, -1, 5]).mean().item()


def _run(m, ids, put=None):
    """One forward with ``put = {(layer, head or "mlp"): value}`` replacing a head's slice of the z entering W^O
    ``(B, L, d)`` or an MLP's output; returns the logits, the stream entering ln_f, z per layer and MLP outputs."""
    put = put or {}
    d = m.config.d_model // m.config.n_heads
    got, hooks = {"z": {}, "mlp": {}}, []

    def pre(l):
        def hook(mod, args):
            z = args[0].clone()
            for (l2, h), v in put.items():
                if l2 == l and h != "mlp":
                    z[..., h * d:(h + 1) * d] = v
            got["z"][l] = z
            return (z,)
        return hook

    def post_mlp(l):
        def hook(mod, args, out):
            out = put.get((l, "mlp"), out)
            got["mlp"][l] = out
            return out
        return hook

    for l, b in enumerate(m.blocks):
        hooks.append(b.attn.out_proj.register_forward_pre_hook(pre(l), prepend=True))
        hooks.append(b.mlp.register_forward_hook(post_mlp(l), prepend=True))
    hooks.append(m.ln_f.register_forward_pre_hook(lambda mod, args: got.__setitem__("x", args[0])))
    try:
        with torch.no_grad():
            got["logits"] = m(ids).logits
    finally:
        for h in hooks:
            h.remove()
    return got


def _z(run, l, h, d):
    return run["z"][l][..., h * d:(h + 1) * d]


def _out(m, run, name):
    """What sender ``name`` adds to the stream: z_h @ W_O[h] for a head, the MLP's output for an MLP."""
    d = m.config.d_model // m.config.n_heads
    if name.startswith("m"):
        return run["mlp"][int(name[1:])]
    l, h = int(name[1:].split(".")[0]), int(name.split(".h")[1])
    return _z(run, l, h, d) @ m.blocks[l].attn.out_proj.weight[:, h * d:(h + 1) * d].T


def _ablated(ablation, corrupt_value):
    if ablation == "patch":
        return corrupt_value
    if ablation == "mean":
        return corrupt_value.mean(0, keepdim=True).expand_as(corrupt_value)
    return torch.zeros_like(corrupt_value)


def by_hand(m, clean, corrupt, name, ablation="patch", partner=None):
    """``{total, direct, comp: {k: ...}, pair, alone}`` of head ``name``, through the model's own modules."""
    d = m.config.d_model // m.config.n_heads
    l, h = int(name[1:].split(".")[0]), int(name.split(".h")[1])
    c, k = _run(m, clean), _run(m, corrupt)
    m_clean = _ld(c["logits"])

    def readout(x):  # the model's own final norm and tied unembedding
        return m.ln_f(x) @ m.tok_emb.weight.T

    def key(s):
        return (int(s[1:]), "mlp") if s.startswith("m") else (int(s[1:].split(".")[0]), int(s.split(".h")[1]))

    def value(s, run):
        return run["mlp"][int(s[1:])] if s.startswith("m") else _z(run, *key(s), d)

    with torch.no_grad():
        ab = _run(m, clean, {(l, h): _ablated(ablation, _z(k, l, h, d))})
        W = m.blocks[l].attn.out_proj.weight[:, h * d:(h + 1) * d]
        direct = _ld(readout(c["x"] + _ablated(ablation, _z(k, l, h, d)) @ W.T - _z(c, l, h, d) @ W.T)) - m_clean
        comp = {s: _ld(readout(c["x"] + _out(m, ab, s) - _out(m, c, s))) - m_clean
                for s in downstream(graph(m), name)}
        out = {"total": _ld(ab["logits"]) - m_clean, "direct": direct, "comp": comp}
        if partner is not None:
            both = {(l, h): _ablated(ablation, _z(k, l, h, d)), key(partner): _ablated(ablation, value(partner, k))}
            out["pair"] = _ld(_run(m, clean, both)["logits"]) - m_clean
            alone = {key(partner): _ablated(ablation, value(partner, k))}
            out["alone"] = _ld(_run(m, clean, alone)["logits"]) - m_clean
    return out


# ---- against headlab.patch, edge_patch and the hand computation ----------------------------------------------

def test_total_is_patch_direct_is_edge_patch():
    m = tiny()
    heads = ["a0.h0", (1, 1), "a2.h2", "a1.h3"]
    r = self_repair(m, CLEAN, CORRUPT, METRIC, heads)
    node = headlab.patch(m, CLEAN, CORRUPT, METRIC).raw["z"]  # (layers, heads): m_patched - m_clean
    names = ["a0.h0", "a1.h1", "a2.h2", "a1.h3"]
    edges = edge_patch(m, CLEAN, CORRUPT, METRIC, edges=[f"{h}->logits" for h in names]).scores
    assert [h.head for h in r.heads] == names
    for h in r.heads:
        l, i = int(h.head[1]), int(h.head[-1])
        assert h.total == pytest.approx(float(node[l, i]), abs=1e-6)
        assert h.direct == pytest.approx(edges[f"{h.head}->logits"], abs=1e-6)
        assert h.self_repair == pytest.approx(h.total - h.direct, abs=1e-12)
        assert h.other == pytest.approx(h.self_repair - sum(h.compensation.values()), abs=1e-12)
    assert min(abs(h.direct) for h in r.heads) > 0.1 * abs(r.gap)  # the heads matter: the check is not 0 == 0
    assert r.clean == pytest.approx(_ld(m(CLEAN).logits)) and r.corrupted == pytest.approx(_ld(m(CORRUPT).logits))


@pytest.mark.parametrize("name", ["llama", "gpt_neox"])
def test_hugging_face_rmsnorm_gqa_and_parallel_blocks(name):
    """Llama (RMSNorm, grouped kv heads) and GPT-NeoX (parallel blocks: a layer's MLP does not read its heads)."""
    from tests import architectures as arch

    m = arch.build(name).double()
    clean, corrupt = CLEAN + 10, CORRUPT + 10
    r = self_repair(m, clean, corrupt, METRIC, ["a0.h1", "a1.h2"])
    node = headlab.patch(m, clean, corrupt, METRIC).raw["z"]
    edges = edge_patch(m, clean, corrupt, METRIC, edges=["a0.h1->logits", "a1.h2->logits"]).scores
    for h, (l, i) in zip(r.heads, [(0, 1), (1, 2)]):
        assert h.total == pytest.approx(float(node[l, i]), abs=1e-6)
        assert h.direct == pytest.approx(edges[f"{h.head}->logits"], abs=1e-6)
    own = "m0" in r["a0.h1"].compensation
    assert own == (name == "llama") and r["a1.h2"].compensation.keys() == ({"m1"} if own else set())


@pytest.mark.parametrize("ablation", ["patch", "mean", "zero"])
def test_every_number_against_the_model_by_hand(ablation):
    m = tiny(seed=1)
    want = {name: by_hand(m, CLEAN, CORRUPT, name, ablation) for name in ("a0.h2", "a1.h1")}
    r = self_repair(m, CLEAN, CORRUPT, METRIC, list(want), ablation=ablation)
    for name, w in want.items():
        h = r[name]
        assert h.total == pytest.approx(w["total"], abs=1e-5)
        assert h.direct == pytest.approx(w["direct"], abs=1e-5)
        assert sorted(h.compensation) == sorted(w["comp"])
        for k, v in w["comp"].items():
            assert h.compensation[k] == pytest.approx(v, abs=1e-5), k
        assert any(abs(v) > 1e-2 for v in w["comp"].values())  # the ablation moves what downstream writes
        # the partner is the component that undoes most of the direct effect, and the pair ablation is measured
        best = compensators(w["comp"], w["direct"])
        assert h.partner == (best[0][0] if best else None)
        if h.partner is not None:
            p = by_hand(m, CLEAN, CORRUPT, name, ablation, partner=h.partner)
            assert h.pair == pytest.approx(p["pair"], abs=1e-5)
            assert h.partner_alone == pytest.approx(p["alone"], abs=1e-5)
    assert r.ablation == ablation and r.n_examples == 2


# ---- a planted backup head ----------------------------------------------------------------------------------

def planted(backup: float = 1.0) -> Transformer:
    """Head 0.0 writes the answer direction f3 at the last position when the signal token 3 is in the prompt
    (uniform attention, its value reads the signal's feature f2). Head 1.0's query reads f3 (the answer already
    written) and a constant f4; its keys are f0 at BOS and f1 at the signal's position: with 0.0's write present it
    attends to BOS (value 0), without it to the signal, whose value it writes as f3 too, ``backup`` times 0.0's size.
    Everything else is zero; the corrupted prompt has token 9 (the key f1 without the value f2) for the signal."""
    m = Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=4, d_ff=4, causal=True)).eval()
    m = m.double()
    f = torch.zeros(8, 16, dtype=torch.double)  # zero-mean directions, so the LayerNorms' centring leaves them be
    for i in range(8):
        f[i, 2 * i], f[i, 2 * i + 1] = 1.0, -1.0
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        for ln in [m.ln_f, *(b.ln1 for b in m.blocks), *(b.ln2 for b in m.blocks)]:
            ln.weight.fill_(1.0)
        E = m.tok_emb.weight
        E[:] = 10 * f[5] + f[4]  # filler: a large stream, so the final norm is nearly linear in the heads' writes
        E[1] = f[0] + f[4]  # BOS
        E[3] = f[1] + f[2] + f[4]  # the signal
        E[9] = f[1] + f[4]  # the corrupted signal
        E[2], E[5] = f[3], -f[3]  # the answer 2 against 5: logit_diff(2, 5) reads f3
        A, B = m.blocks[0].attn, m.blocks[1].attn
        A.v_proj.weight[0] = f[2]
        A.out_proj.weight[:, 0] = 3 * f[3]
        B.q_proj.weight[0], B.q_proj.weight[1] = 40 * f[3], 20 * f[4]
        B.k_proj.weight[0], B.k_proj.weight[1] = f[0], f[1]
        B.v_proj.weight[0] = f[2]
        B.out_proj.weight[:, 0] = backup * 3 / 6 * f[3]  # 0.0 averages over 6 positions, 1.0 reads one
    return m


P_CLEAN, P_CORRUPT = torch.tensor([[1, 3, 4, 6, 7, 8]]), torch.tensor([[1, 9, 4, 6, 7, 8]])


def test_planted_backup_head_is_found():
    m = planted()
    want = by_hand(m, P_CLEAN, P_CORRUPT, "a0.h0", partner="a1.h0")
    r = self_repair(m, P_CLEAN, P_CORRUPT, METRIC, ["a0.h0", "a1.h0", "a0.h1"])
    h = r["a0.h0"]
    assert r.clean > 1.0 and r.corrupted == pytest.approx(0.0, abs=1e-6)
    assert h.direct == pytest.approx(-r.clean, rel=1e-6)  # 0.0 is the only writer of f3
    assert abs(h.total) < 1e-3 * r.clean  # ... yet ablating it changes nothing: 1.0 takes over
    assert h.self_repair == pytest.approx(r.clean, rel=1e-3) and h.undone == pytest.approx(1.0, abs=1e-3)
    assert h.top[0][0] == "a1.h0" and h.compensation["a1.h0"] == pytest.approx(want["comp"]["a1.h0"], abs=1e-5)
    assert h.compensation["a1.h0"] > 0.85 * h.self_repair  # the rest is the final norm's rescaling
    assert all(abs(v) < 1e-6 for k, v in h.compensation.items() if k != "a1.h0")
    assert r.backups["a0.h0"] == ["a1.h0"]
    assert h.pair == pytest.approx(-r.clean, rel=1e-6) and abs(h.partner_alone) < 1e-3 * r.clean
    assert (h.verdict, h.partner) == ("duplicated", "a1.h0")
    assert r["a1.h0"].verdict == "unused" and r["a0.h1"].verdict == "unused"  # 1.0 writes nothing on the clean run


@pytest.mark.parametrize("backup,verdict", [(0.7, "compensated"), (0.2, "irreplaceable")])
def test_planted_partial_backup(backup, verdict):
    h = self_repair(planted(backup), P_CLEAN, P_CORRUPT, METRIC, ["a0.h0"])["a0.h0"]
    assert h.undone == pytest.approx(backup, abs=0.02)
    assert h.verdict == verdict and h.top[0][0] == "a1.h0"


# ---- the verdict rules ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("total,direct,extra,verdict", [
    (0.01, -0.02, {}, "unused"),  # both below 0.05 x |gap| = 0.2
    (-2.0, 0.05, {}, "irreplaceable"),  # acts through downstream components
    (-2.0, -3.0, {}, "irreplaceable"),  # total keeps 67% of direct: 33% undone < 50%
    (-1.4, -3.0, {}, "compensated"),  # 53% undone
    (1.0, -3.0, {}, "compensated"),  # over-corrected: 133% undone, |total| still within half of |direct|
    (2.0, -3.0, {}, "irreplaceable"),  # 167% undone: the downstream effect outweighs the direct one
    (-0.6, 0.05, {}, "irreplaceable"),  # a small direct effect, a large opposite total: not compensation
    (1.4, 3.0, {}, "compensated"),  # a head that lowers the metric, repaired downwards
    (2.0, 3.0, {}, "irreplaceable"),
    (-0.1, -3.0, dict(partner="a2.h0", pair=-3.0, partner_alone=-0.2), "duplicated"),
    (-0.1, -3.0, dict(partner="a2.h0", pair=-1.0, partner_alone=-0.2), "compensated"),  # the pair moves too little
    (-1.0, -3.0, dict(partner="a2.h0", pair=-3.0, partner_alone=0.0), "compensated"),  # alone it moves 1/3: not little
    (-0.1, -3.0, dict(partner="a2.h0", pair=-3.0, partner_alone=-2.8), "compensated"),  # the partner alone does it
    (math.nan, -3.0, {}, "unmeasured"),
])
def test_verdicts_on_constructed_numbers(total, direct, extra, verdict):
    got, evidence = judge(total, direct, -4.0, Rules(), **extra)
    assert got == verdict and evidence
    if verdict == "duplicated":
        assert "a2.h0" in evidence


def test_rules_thresholds_are_the_stated_ones():
    assert judge(-1.5, -3.0, -4.0)[0] == "compensated" and judge(1.5, -3.0, -4.0)[0] == "compensated"  # the edges
    assert judge(-1.5, -3.0, -4.0, Rules(repaired=0.6))[0] == "irreplaceable"
    assert judge(0.3, -0.3, -4.0, Rules(tol=0.1))[0] == "unused"
    assert judge(0.0, 0.0, -4.0, Rules(tol=0.0))[0] == "unused"
    assert "by a2.h0, m2" in judge(-0.5, -3.0, -4.0, by=["a2.h0", "m2"])[1]
    assert compensators({"a1.h0": 2.0, "m1": -1.0}, 3.0) == [("m1", -1.0)]  # direct > 0: repair pushes down
    for bad in (dict(tol=-0.1), dict(repaired=float("nan")), dict(top=0), dict(joint="x")):
        with pytest.raises(ConfigError, match="Rules"):
            Rules(**bad)


# ---- errors, before any forward ------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,kw,match", [
    ([], {}, "heads is empty"),
    (["a7.h0"], {}, "not a head of this model"),
    (["a0.h9"], {}, "not a head of this model"),
    (["m1"], {}, "not a head of this model"),
    (["input"], {}, "not a head of this model"),
    ([(0, 1), "a0.h1"], {}, "listed twice"),
    ([(0, "x")], {}, "neither a head name"),
    ([1.5], {}, "neither a head name"),
    (["a0.h1"], dict(ablation="uniform"), "choose from"),
    (["a0.h1"], dict(rules={"tol": 0.1}), "Rules"),
    (["a0.h1"], dict(max_rows=0), "max_rows"),
])
def test_typed_errors_before_any_forward(heads, kw, match):
    m = tiny()

    def refuse(mod, args):
        raise RuntimeError("the model ran before the arguments were checked")

    hook = m.register_forward_pre_hook(refuse)
    try:
        with pytest.raises(ConfigError, match=match):
            self_repair(m, CLEAN, CORRUPT, METRIC, heads, **kw)
    finally:
        hook.remove()


def test_resample_needs_two_pairs_and_no_gap_is_refused():
    m = tiny()
    with pytest.raises(ConfigError, match="at least 2 pairs"):
        self_repair(m, CLEAN[:1], CORRUPT[:1], METRIC, ["a0.h0"], ablation="resample")
    with pytest.raises(InputError, match="no gap"):
        self_repair(m, CLEAN, CLEAN.flip(0), lambda logits: logits[:, -1, 0] * 0, ["a0.h0"])


# ---- the result -----------------------------------------------------------------------------------------------

def test_result_file_table_and_interrupt(tmp_path):
    m = tiny()
    r = self_repair(m, CLEAN, CORRUPT, METRIC, ["a0.h0", "a1.h3", "a2.h1"])
    path = r.save(tmp_path / "selfrepair.json")
    assert Result.load(path).kind == KIND == "circuit_self_repair"
    back = SelfRepair.load(path)
    assert [(h.head, h.verdict, h.partner) for h in back.heads] == [(h.head, h.verdict, h.partner) for h in r.heads]
    for a, b in zip(back.heads, r.heads):
        assert a.total == b.total and a.direct == b.direct and a.compensation == b.compensation and a.top == b.top
    assert back.rules == r.rules and back.notes == r.notes
    text = r.table()
    assert all(h.head in text and h.verdict in text for h in r.heads) and "rules:" in text and "self-repair" in text
    assert r["a2.h1"].compensation == {"m2": r["a2.h1"].compensation["m2"]}  # only its own layer's MLP reads it
    with pytest.raises(InputError, match="not self-repair"):
        SelfRepair.from_result(Result("edge_scores", model="x"))

    def stop(stage, done, total):  # Ctrl-C after the first head
        if done == 1:
            raise KeyboardInterrupt

    cut = self_repair(m, CLEAN, CORRUPT, METRIC, ["a0.h0", "a1.h3", "a2.h1"], max_rows=2, progress=stop)
    assert [h.verdict for h in cut.heads][1:] == ["unmeasured", "unmeasured"]
    assert cut.heads[0].total == pytest.approx(r.heads[0].total) and "interrupted after 1 of 3" in cut.notes[-1]
    assert math.isnan(cut.heads[1].total) and not math.isnan(cut.heads[1].direct)
    assert "unmeasured" in cut.table()
    SelfRepair.load(cut.save(tmp_path / "cut.json"))  # NaN written as null and read back
