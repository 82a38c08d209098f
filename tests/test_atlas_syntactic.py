"""The syntactic kind's causal check: on a tiny Llama with a word-level tokenizer and a treebank written here,
every per-example effect equals the loss on the dependents' tokens computed by hand with the heads gated
through the adapter's own gates; the relations are each top head's best relation in the probe's own rows;
the verdict follows the rule and is reproduced from the JSON; an encoder is skipped with its reason."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

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
    return headlab.load(folder), tb, sents


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
    from headlab.interpret.probing import probe

    ld, tb, sents = setup
    a = atlas(ld, kinds=["syntactic"], treebank=tb, k=2, n_draws=10, n_boot=300, copying=False, evidence=False,
              max_rows=5)  # batches of at most 5 sentences: the check runs over several batches
    v = a.verdicts["syntactic"]
    assert "syntactic check" not in a.skipped
    assert v["heads"] == [list(x) for x in a.top("syntactic", 2)] and len(v["draws"]) == 10
    # the relations: each top head's best margin among the probe's rows with enough cases
    r = probe(ld, tb, head_map_sentences=0, grad_sentences=0, loss_model=None)
    want_rel = set()
    for l, h in v["heads"]:
        rows = [x for x in r.relations if (x.layer, x.head) == (l, h) and x.count >= r.min_count]
        want_rel.add(max(rows, key=lambda x: x.accuracy - x.baseline_accuracy).relation)
    assert v["relations"] == sorted(want_rel)
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
    _, tb, _ = setup
    enc = headlab.load(save_word_level(tmp_path / "bert", build("bert"), WORDS))
    a = atlas(enc, kinds=["syntactic"], treebank=tb, k=2, copying=False, evidence=False)
    assert "syntactic" in a.scores and "syntactic" not in a.verdicts
    assert a.skipped["syntactic check"] == D.NO_LM


def test_too_few_sentences_skip_the_check_with_the_reason(setup):
    ld, tb, _ = setup
    a = atlas(ld, kinds=["syntactic"], treebank=tb, treebank_limit=1, k=2, copying=False, evidence=False)
    assert "syntactic" in a.scores and "syntactic" not in a.verdicts
    assert "needs at least 2" in a.skipped["syntactic check"]
