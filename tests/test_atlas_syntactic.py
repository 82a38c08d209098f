"""The syntactic kind's causal check: on a tiny Llama with a word-level tokenizer and a treebank written here,
every per-example effect equals the loss on the dependents' tokens computed by hand with the heads gated
through the adapter's own gates; the syntactic scores and each top head's relation equal Clark et al.'s
definition computed here from the gold arcs and Hugging Face's own eager attention maps (not the probe);
the verdict follows the rule and is reproduced from the JSON; an encoder is skipped with its reason."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
import torch.nn.functional as F
import transformers

import headlab
from architectures import build
from conftest import save_word_level
from headlab.interpret.atlas import Atlas, atlas
from headlab.interpret.atlas import causal as CK
from headlab.interpret.atlas import dependents as D

DETS, ADJS, NOUNS = ["the", "a", "my"], ["old", "red", "small", "happy"], ["cat", "dog", "man", "tree", "book", "car"]
VERBS, PREPS = ["saw", "sat", "found", "liked"], ["on", "near", "under"]
WORDS = ["<pad>", "<unk>", *DETS, *ADJS, *NOUNS, *VERBS, *PREPS, "."]


def _sentences(n: int, seed: int = 0) -> list[list[tuple[str, int, str]]]:
    """``n`` sentences as (form, head index 1-based, deprel): "det (adj) noun verb prep det noun ."."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        adj = rng.random() < 0.5
        words = [(rng.choice(DETS), 3 if adj else 2, "det")]
        if adj:
            words.append((rng.choice(ADJS), 3, "amod"))
        subj = len(words) + 1
        words.append((rng.choice(NOUNS), subj + 1, "nsubj"))
        verb = len(words) + 1
        words.append((rng.choice(VERBS), 0, "root"))
        words += [(rng.choice(PREPS), verb + 3, "case"), (rng.choice(DETS), verb + 3, "det"),
                  (rng.choice(NOUNS), verb, "obl"), (".", verb, "punct")]
        out.append(words)
    return out


def _conllu(sentences) -> str:
    blocks = []
    for i, s in enumerate(sentences):
        lines = [f"# sent_id = s{i}", f"# text = {' '.join(w for w, _, _ in s)}"]
        lines += [f"{j + 1}\t{w}\t_\t_\t_\t_\t{h}\t{r}\t_\t_" for j, (w, h, r) in enumerate(s)]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks) + "\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("syntactic")
    sents = _sentences(14)
    tb = tmp / "tiny.conllu"
    tb.write_text(_conllu(sents))
    folder = save_word_level(tmp / "llama", build("llama"), WORDS)
    return headlab.load(folder), tb, sents, folder


OFFSETS = [o for o in range(-5, 6) if o != 0]  # the fixed offsets of the baseline
MIN_COUNT = 10  # the probe's default: a relation needs this many cases


def _hand_margins(folder, sents) -> dict[tuple[str, str], torch.Tensor]:
    """Clark et al. (2019) by hand: ``{(direction, relation): (layers, heads) accuracy - best fixed-offset
    baseline}`` for every relation with at least MIN_COUNT cases, from the gold arcs of ``sents`` and the
    attention maps of a fresh eager copy of the model (``output_attentions``; one token per word here).
    A head predicts, for each word, the other word it attends to most (none when it gives none any weight);
    dep->head: one case per dependent, right when that is its head; head->dep: one case per (head word,
    relation) with such dependents, right when the prediction is one of them."""
    eager = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    vocab = {w: i for i, w in enumerate(WORDS)}
    cases, hits, base = {}, {}, {}
    for s in sents:
        n = len(s)
        with torch.no_grad():
            att = torch.stack(eager(torch.tensor([[vocab[w] for w, _, _ in s]]), output_attentions=True).attentions)
        att = att[:, 0].double().clone()  # (layers, heads, n, n)
        att[..., range(n), range(n)] = -1.0  # a word never predicts itself
        val, pred = att.max(-1)
        pred = torch.where(val > 0, pred, -1)  # (layers, heads, n)
        head = [h - 1 for _, h, _ in s]  # 0-based, -1 for the root
        rel = [r for _, _, r in s]
        deps = [d for d in range(n) if rel[d] != "root"]
        units = {(head[d], rel[d]) for d in deps}
        for d in deps:
            key = ("dep->head", rel[d])
            cases[key] = cases.get(key, 0) + 1
            hits[key] = hits.get(key, 0) + (pred[..., d] == head[d]).double()
            for o in OFFSETS:
                base[key, o] = base.get((key, o), 0) + (head[d] == d + o)
        for w, r in units:
            key, mine = ("head->dep", r), [d for d in deps if head[d] == w and rel[d] == r]
            cases[key] = cases.get(key, 0) + 1
            hits[key] = hits.get(key, 0) + sum((pred[..., w] == d).double() for d in mine)
            for o in OFFSETS:
                base[key, o] = base.get((key, o), 0) + (w + o in mine)
    return {key: hits[key] / c - max(base[key, o] for o in OFFSETS) / c for key, c in cases.items() if c >= MIN_COUNT}


def _hand_loss(ld, ids: list[int], targets: list[int], gated: list[tuple[int, int]]) -> float:
    """Mean NLL of the tokens at ``targets`` with the heads ``gated`` switched off by the adapter's gates."""
    ad = ld.adapter
    g = torch.ones(ad.n_layers, ad.n_heads)
    for l, h in gated:
        g[l, h] = 0
    ad.gates = g
    try:
        with torch.no_grad():
            logp = torch.log_softmax(ld.model(torch.tensor([ids])).logits[0].double(), -1)
    finally:
        ad.reset_gates()
    return float(sum(-logp[t - 1, ids[t]] for t in targets) / len(targets))


def test_effects_equal_a_hand_computation_and_the_verdict_follows_the_rule(setup, tmp_path):
    ld, tb, sents, folder = setup
    a = atlas(ld, kinds=["syntactic"], treebank=tb, k=2, n_draws=10, n_boot=300, copying=False, evidence=False,
              max_rows=5)  # batches of at most 5 sentences: the check runs over several batches
    v = a.verdicts["syntactic"]
    assert "syntactic check" not in a.skipped
    assert v["heads"] == [list(x) for x in a.top("syntactic", 2)] and len(v["draws"]) == 10
    # the scores: each head's best margin over the relations with enough cases, by hand
    margins = _hand_margins(folder, sents)
    assert {r for _, r in margins} == {"det", "nsubj", "case", "obl", "punct"}  # amod has 6 cases: too few
    want = torch.stack(list(margins.values())).amax(0)
    assert torch.allclose(a.scores["syntactic"], want, atol=1e-9), (a.scores["syntactic"], want)
    assert len({round(float(x), 9) for x in want.flatten()}) > 3  # the heads differ: not one value for all
    # the relations: each top head's relation of largest margin (any of them where several tie)
    tied = [{r for (_, r), m in margins.items() if abs(float(m[l, h]) - float(want[l, h])) < 1e-9}
            for l, h in v["heads"]]
    assert any(v["relations"] == sorted(set(pick)) for pick in itertools.product(*tied)), (v["relations"], tied)
    want_rel = set(v["relations"])
    # the targets: word-level tokens, no specials, so token i is word i; dependents of those relations past word 0
    vocab = {w: i for i, w in enumerate(WORDS)}
    cases = [([vocab[w] for w, _, _ in s], [j for j, (_, _, rel) in enumerate(s) if rel in want_rel and j >= 1])
             for s in sents]
    cases = sorted((c for c in cases if c[1]), key=lambda c: len(c[0]))  # the check's order: by length, then file
    assert v["n_examples"] == len(cases) >= 2 and v["targets"] == sum(len(t) for _, t in cases)
    base = [_hand_loss(ld, ids, t, []) for ids, t in cases]
    assert v["baseline"] == pytest.approx(sum(base) / len(base), abs=1e-5)
    for gated_set, got in [(v["heads"], v["effects"]["targeted"])] + list(zip(v["draws"], v["effects"]["random"])):
        want = [_hand_loss(ld, ids, t, [tuple(x) for x in gated_set]) - b for (ids, t), b in zip(cases, base)]
        assert got == pytest.approx(want, abs=1e-5)
    assert max(abs(x) for x in v["effects"]["targeted"]) > 1e-4  # gating moved the loss: not 0 == 0
    # the verdict rule, on the stored numbers
    t, rmean, rhi = v["targeted"], v["random_mean"], v["random_max_upper"]
    causal = t > 0 and t >= 3 * max(rmean, 0) and v["targeted_ci"][0] > rhi
    assert v["verdict"] == ("causal" if causal else "not confirmed")
    assert t == pytest.approx(sum(v["effects"]["targeted"]) / len(cases), abs=1e-9)
    # reproduced from the JSON
    path = tmp_path / "atlas.json"
    path.write_text(json.dumps(a.to_json()))
    re = Atlas.from_json(path).recheck("syntactic")
    assert re["verdict"] == v["verdict"] and re["targeted_ci"] == pytest.approx(v["targeted_ci"], abs=1e-6)  # effects kept to 8 places


def test_the_target_loss_metric_against_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11)  # two configurations of two rows
    ids = torch.randint(0, 11, (4, 6))
    targets = torch.tensor([[0, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    got = CK.target_loss(targets)(type("Out", (), {"logits": logits})(), {"input_ids": ids})
    for row in range(4):
        pos = targets[row % 2].nonzero()[:, 0]
        want = F.cross_entropy(logits[row, pos - 1], ids[row, pos])
        assert float(got[row]) == pytest.approx(float(want), abs=1e-6)


def test_an_encoder_is_scored_but_its_check_is_skipped(setup, tmp_path):
    _, tb, _, _ = setup
    enc = headlab.load(save_word_level(tmp_path / "bert", build("bert"), WORDS))
    a = atlas(enc, kinds=["syntactic"], treebank=tb, k=2, copying=False, evidence=False)
    assert "syntactic" in a.scores and "syntactic" not in a.verdicts
    assert a.skipped["syntactic check"] == D.NO_LM


def test_too_few_sentences_skip_the_check_with_the_reason(setup):
    ld, tb, _, _ = setup
    a = atlas(ld, kinds=["syntactic"], treebank=tb, treebank_limit=1, k=2, copying=False, evidence=False)
    assert "syntactic" in a.scores and "syntactic" not in a.verdicts
    assert "needs at least 2" in a.skipped["syntactic check"]
