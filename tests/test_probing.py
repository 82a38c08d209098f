"""headlab.probe: CoNLL-U reading, token-word alignment, word-level attention, accuracies and baselines
against direct loops over Clark et al.'s (2019) definitions; tiny random BERT and Llama end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from headlab.errors import InputError, ModelError, TreebankError
from headlab.interpret.probing import align as al
from headlab.interpret.probing.gold import OFFSETS, gold_counts
from headlab.interpret.probing.measures import classical_mds, js_sums
from headlab.interpret.probing.probe_result import ProbeResult, head_annotations
from headlab.interpret.probing.head_scores import probe
from headlab.interpret.probing.treebank import read_treebank
from conftest import run_cli

# Sentence 1 has a split word (unbelievable), a multi-word token (didn't = did + n't) and an empty
# node (9.1); sentence 2 a subtype (nmod:poss); sentence 3 a cycle; sentence 4 no root.
CONLLU = """# sent_id = s1
# text = The unbelievable cat didn't sit on the mat.
1\tThe\tthe\tDET\t_\t_\t3\tdet\t_\t_
2\tunbelievable\t_\tADJ\t_\t_\t3\tamod\t_\t_
3\tcat\t_\tNOUN\t_\t_\t6\tnsubj\t_\t_
4-5\tdidn't\t_\t_\t_\t_\t_\t_\t_\t_
4\tdid\t_\tAUX\t_\t_\t6\taux\t_\t_
5\tn't\t_\tPART\t_\t_\t6\tadvmod\t_\t_
6\tsit\t_\tVERB\t_\t_\t0\troot\t_\t_
7\ton\t_\tADP\t_\t_\t9\tcase\t_\t_
8\tthe\t_\tDET\t_\t_\t9\tdet\t_\t_
9\tmat\t_\tNOUN\t_\t_\t6\tobl\t_\tSpaceAfter=No
9.1\tsat\t_\tVERB\t_\t_\t_\t_\t6:conj\t_
10\t.\t_\tPUNCT\t_\t_\t6\tpunct\t_\t_

# sent_id = s2
1\tShe\t_\tPRON\t_\t_\t2\tnsubj\t_\t_
2\treads\t_\tVERB\t_\t_\t0\troot\t_\t_
3\ther\t_\tPRON\t_\t_\t4\tnmod:poss\t_\t_
4\tbooks\t_\tNOUN\t_\t_\t2\tobj\t_\tSpaceAfter=No
5\t.\t_\tPUNCT\t_\t_\t2\tpunct\t_\t_

# sent_id = s3-cycle
1\tA\t_\tDET\t_\t_\t2\tdet\t_\t_
2\tB\t_\tNOUN\t_\t_\t3\tnsubj\t_\t_
3\tC\t_\tVERB\t_\t_\t2\tccomp\t_\t_
4\tD\t_\tVERB\t_\t_\t0\troot\t_\t_

# sent_id = s4-noroot
1\tA\t_\tDET\t_\t_\t2\tdet\t_\t_
2\tB\t_\tNOUN\t_\t_\t1\tnsubj\t_\t_

"""
TEXTS = ["The unbelievable cat didn't sit on the mat.", "She reads her books."]
WP_VOCAB = ("[PAD] [UNK] [CLS] [SEP] the un ##believ ##able cat did ##n ' t sit on mat . she reads her book "
            "##s").split()


@pytest.fixture
def treebank(tmp_path):
    p = tmp_path / "tiny.conllu"
    p.write_text(CONLLU, encoding="utf-8")
    return p


def wordpiece():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(WP_VOCAB)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]",
                                                sep_token="[SEP]", pad_token="[PAD]")


def bpe(kind="bytelevel", vocab_size=None):
    """A GPT-2-style byte-level BPE (leading-space marker) or a SentencePiece-style Metaspace BPE, trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if kind == "metaspace" else None))
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    vocab_size = vocab_size or (290 if kind == "bytelevel" else 60)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "<pad>", "<unk>"], initial_alphabet=alphabet)
    tok.train_from_iterator(TEXTS * 3 + ["the cat sat on a mat", "books and cats"], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>", unk_token="<unk>")


def oracle_word_tokens(tokenizer, sentence):
    """Each word's tokens, found without offsets: walk the text with each token's own string."""
    ids = tokenizer(sentence.text)["input_ids"]
    special = set(tokenizer.all_special_ids)
    pieces = [tokenizer.convert_ids_to_tokens(i).replace("Ġ", " ").replace("▁", " ").replace("##", "") for i in ids]
    pos = 0
    out = [[] for _ in sentence.words]
    first = True
    for t, (i, piece) in enumerate(zip(ids, pieces)):
        if i in special:
            continue
        if first and piece.startswith(" ") and not sentence.text.startswith(" "):
            pos -= 1  # a SentencePiece-style marker prepended to the first word
        first = False
        while piece and not piece.startswith(" ") and sentence.text[pos:pos + 1] == " ":
            pos += 1  # WordPiece: spaces between tokens are not in the tokens
        s, e = pos, pos + len(piece)
        pos = e
        while s < e and (s < 0 or sentence.text[s] == " "):
            s += 1
        for w, (a, b) in enumerate(sentence.spans):
            if s < e and a < e and s < b:
                out[w].append(t)
    return out


# ---- reading --------------------------------------------------------------------------------------


def test_reader_multiword_tokens_empty_nodes_subtypes_and_bad_trees(treebank):
    tb = read_treebank(treebank)
    assert [s.sent_id for s in tb.sentences] == ["s1", "s2"]
    s1, s2 = tb.sentences
    assert s1.words == ("The", "unbelievable", "cat", "did", "n't", "sit", "on", "the", "mat", ".")  # 9.1 skipped
    assert s1.heads.tolist() == [2, 2, 5, 5, 5, -1, 8, 8, 5, 5]
    assert [s1.text[a:b] for a, b in s1.spans] == list(s1.words)
    assert s1.spans[3] == (21, 24) and s1.spans[4] == (24, 27)  # did | n't inside "didn't"
    assert s2.text == "She reads her books."  # no "# text": rebuilt from the forms and SpaceAfter=No
    assert "nmod:poss" in s2.relations
    assert {(k.sent_id, k.reason.split(" ")[0]) for k in tb.skipped} == {("s3-cycle", "cycle"), ("s4-noroot", "no")}
    folded = read_treebank(treebank, fold_subtypes=True)
    assert "nmod" in folded.sentences[1].relations and "nmod:poss" not in folded.relation_counts()
    assert len(read_treebank(treebank, limit=1).sentences) == 1


def test_multiword_token_whose_words_do_not_spell_it(tmp_path):
    p = tmp_path / "fr.conllu"
    p.write_text("# text = du pain\n1-2\tdu\t_\t_\t_\t_\t_\t_\t_\t_\n1\tde\t_\tADP\t_\t_\t3\tcase\t_\t_\n"
                 "2\tle\t_\tDET\t_\t_\t3\tdet\t_\t_\n3\tpain\t_\tNOUN\t_\t_\t0\troot\t_\t_\n\n")
    s = read_treebank(p).sentences[0]
    assert s.spans[:2] == ((0, 2), (0, 2))  # each word is the whole surface token


@pytest.mark.parametrize("content, match", [
    ("1\tThe\tthe\n", r":1: not CoNLL-U: expected 10 tab-separated columns"),
    ("# c\n1 The the DET _ _ 0 root _ _\n", r":2: .*separated by tabs"),
    ("x\tThe\t_\t_\t_\t_\t0\troot\t_\t_\n", r":1: .*ID 'x'"),
    ("1\tA\t_\t_\t_\t_\t0\troot\t_\t_\n3\tB\t_\t_\t_\t_\t1\tdep\t_\t_\n", r":2: .*word id 3 follows word 1"),
    ("1\tA\t_\t_\t_\t_\tzero\troot\t_\t_\n", r":1: .*HEAD 'zero'"),
    ("", "holds no sentence"),
    ("# only a comment\n", "holds no sentence|comments only"),
])
def test_not_conllu_says_line_and_why(tmp_path, content, match):
    p = tmp_path / "bad.conllu"
    p.write_text(content)
    with pytest.raises(TreebankError, match=match):
        read_treebank(p)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(TreebankError, match="no such treebank file"):
        read_treebank(tmp_path / "nope.conllu")
    p = tmp_path / "bin.conllu"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TreebankError, match="UTF-8"):
        read_treebank(p)


# ---- alignment ------------------------------------------------------------------------------------


def test_wordpiece_alignment_known_answer(treebank):
    tok = wordpiece()
    (a1, a2), skipped = al.align_sentences(tok, read_treebank(treebank).sentences)
    assert not skipped
    # [CLS] the un ##believ ##able cat did ##n ' t sit on the mat . [SEP]
    words = [np.flatnonzero(row).tolist() for row in a1.a_to]
    assert words == [[1], [2, 3, 4], [5], [6], [7, 8, 9], [10], [11], [12], [13], [14]]
    assert a1.special.tolist() == [True] + [False] * 14 + [True]
    assert a1.sep.tolist() == [False] * 15 + [True]
    assert np.flatnonzero(a1.punct).tolist() == [14]
    assert [np.flatnonzero(r).tolist() for r in a2.a_to] == [[1], [2], [3], [4, 5], [6]]  # book ##s


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_bpe_alignment_matches_token_strings(treebank, kind):
    tok = bpe(kind)
    sents = read_treebank(treebank).sentences
    aligned, skipped = al.align_sentences(tok, sents)
    assert not skipped
    for a, s in zip(aligned, sents):
        assert [np.flatnonzero(r).tolist() for r in a.a_to] == oracle_word_tokens(tok, s)
        assert a.special[0] and not a.special[1:].any()  # BOS kept aside
    assert any(len(np.flatnonzero(r)) > 1 for r in aligned[0].a_to)  # some word is split


def test_no_fast_tokenizer_is_a_clear_error():
    class Slow:
        is_fast = False

    with pytest.raises(ModelError, match="not a fast tokenizer.*offsets"):
        al.check_fast(Slow(), "m")


def test_word_attention_equals_loop():
    g = torch.Generator().manual_seed(0)
    att = torch.softmax(torch.randn(2, 3, 7, 7, generator=g), -1)
    a_to = torch.zeros(2, 4, 7)
    groups = [[[1], [2, 3], [4, 5, 6], []], [[1, 2], [3], [4], [5]]]
    for b, ws in enumerate(groups):
        for w, ts in enumerate(ws):
            a_to[b, w, ts] = 1
    got = al.word_attention(att, a_to)
    for b, ws in enumerate(groups):
        for k in range(3):
            for i, ti in enumerate(ws):
                for j, tj in enumerate(ws):
                    want = np.mean([sum(float(att[b, k, x, y]) for y in tj) for x in ti]) if ti else 0.0
                    assert got[b, k, i, j].item() == pytest.approx(want, abs=1e-6)


# ---- accuracies and baselines -------------------------------------------------------------------


def loop_scores(aligned, atts, rel_index):
    """Clark et al.'s definitions, one word and one head at a time. ``atts[s]``: ``(K, T, T)``."""
    K = atts[0].shape[0]
    R = len(rel_index)
    correct = np.zeros((2, K, R))
    count = np.zeros((2, R))
    for a, att in zip(aligned, atts):
        s = a.sentence
        toks = [set(np.flatnonzero(r)) for r in a.a_to]
        n = len(s)
        rel = [rel_index.get(r, -1) if r != "root" else -1 for r in s.relations]
        units = {(int(s.heads[d]), rel[d]) for d in range(n) if rel[d] >= 0}
        for r in range(R):
            count[0, r] += sum(1 for d in range(n) if rel[d] == r)
            count[1, r] += sum(1 for (_, rr) in units if rr == r)
        for k in range(K):
            W = np.array([[np.mean([sum(att[k, x, y] for y in toks[j]) for x in toks[i]]) for j in range(n)]
                          for i in range(n)])
            for i in range(n):
                cands = [j for j in range(n) if not toks[i] & toks[j]]
                best = max(cands, key=lambda j: W[i, j]) if cands else None
                pred = best if best is not None and W[i, best] > 0 else -1
                if rel[i] >= 0 and pred == s.heads[i]:
                    correct[0, k, rel[i]] += 1
                if pred >= 0 and s.heads[pred] == i and rel[pred] >= 0:
                    correct[1, k, rel[pred]] += 1
    return correct, count


@pytest.mark.parametrize("tokenizer", [wordpiece, bpe])
def test_accuracies_equal_loop_on_random_attention(treebank, tokenizer):
    tok = tokenizer()
    tb = read_treebank(treebank)
    aligned, _ = al.align_sentences(tok, tb.sentences)
    rel_index = {r: i for i, (r, _) in enumerate(tb.relation_counts().most_common())}
    b = al.make_batch(aligned, rel_index, 0)
    g = torch.Generator().manual_seed(1)
    T = b.input_ids.shape[1]
    att = torch.softmax(torch.randn(len(aligned), 5, T, T, generator=g) * 3, -1)
    att = att * b.attention_mask[:, None, None, :]
    got = al.score(al.predict(al.word_attention(att, b.a_to), b.candidates), b, len(rel_index))
    atts = [att[i, :, :a.n_tokens, :a.n_tokens].numpy().astype(np.float64) for i, a in enumerate(aligned)]
    want, count = loop_scores(aligned, atts, rel_index)
    np.testing.assert_allclose(got.numpy(), want)
    np.testing.assert_allclose(gold_counts([a.sentence for a in aligned], rel_index).count, count)


def test_gold_oracle_attention_known_answers(treebank):
    """Head 0: every token of a word attends uniformly to the tokens of its gold head, so dep->head is
    always right and head->dep never. Head 1: every word attends to its first dependent, so head->dep
    is right once per head word, credited to that dependent's relation."""
    tok = wordpiece()
    tb = read_treebank(treebank)
    aligned, _ = al.align_sentences(tok, tb.sentences)
    rel_index = {r: i for i, (r, _) in enumerate(tb.relation_counts().most_common())}
    b = al.make_batch(aligned, rel_index, 0)
    B, T = b.input_ids.shape
    att = torch.zeros(B, 2, T, T)
    for i, a in enumerate(aligned):
        t, heads = a.n_tokens, a.sentence.heads
        for w, h in enumerate(heads):
            target = a.a_to[h] if h >= 0 else a.special  # the root looks at [CLS]/[SEP]
            att[i, 0, :t, :t][a.a_to[w]] = torch.from_numpy(target / target.sum()).float()
            deps = np.flatnonzero(heads == w)
            target = a.a_to[deps[0]] if len(deps) else a.special
            att[i, 1, :t, :t][a.a_to[w]] = torch.from_numpy(target / target.sum()).float()
    got = al.score(al.predict(al.word_attention(att, b.a_to), b.candidates), b, len(rel_index))
    count = gold_counts([a.sentence for a in aligned], rel_index).count
    np.testing.assert_allclose(got[0, 0].numpy(), count[0])
    assert got[1, 0].sum() == 0
    # first dependents: cat <- The (det), sit <- cat (nsubj), mat <- on (case), reads <- She (nsubj),
    # books <- her (nmod:poss)
    want = {"det": 1, "nsubj": 2, "case": 1, "nmod:poss": 1}
    assert {r: int(got[1, 1, i]) for r, i in rel_index.items() if got[1, 1, i]} == want


def test_baselines_known_values(treebank):
    tb = read_treebank(treebank)
    rel_index = {r: i for i, r in enumerate(["det", "amod", "obj", "punct"])}
    g = gold_counts(tb.sentences, rel_index)
    o = {off: k for k, off in enumerate(OFFSETS)}
    det, amod, obj, punct = range(4)
    # det: The -> cat (+2), the -> mat (+1)
    assert g.count[0, det] == 2 and g.correct[0, o[2], det] == 1 and g.correct[0, o[1], det] == 1
    assert g.correct[0, o[1], amod] == 1  # unbelievable -> cat
    assert g.correct[0, o[-2], obj] == 1  # books -> reads
    # head->dep: cat has det 'The' at -2; mat has 'the' at -1; reads has obj books at +2
    assert g.correct[1, o[-2], det] == 1 and g.correct[1, o[-1], det] == 1 and g.correct[1, o[2], obj] == 1
    # punct: '.' -> sit (-5 in s1: . is word 10, sit word 6 => -4), '.' -> reads (-3)
    assert g.correct[0, o[-4], punct] == 1 and g.correct[0, o[-3], punct] == 1
    # visible to a decoder: det is never (its head comes after), obj always (the verb comes first)
    assert g.visible[0, det] == 0 and g.visible[0, obj] == 1 and g.visible[1, det] == 2


def test_js_and_mds_against_scipy():
    import scipy.spatial.distance as scipy_spatial

    g = torch.Generator().manual_seed(2)
    att = torch.softmax(torch.randn(4, 5, 6, generator=g), -1)
    got = js_sums(att)
    for i in range(4):
        for j in range(4):
            want = sum(scipy_spatial.jensenshannon(att[i, r].numpy(), att[j, r].numpy()) ** 2 for r in range(5))
            assert got[i, j].item() == pytest.approx(want, abs=1e-5)
    pts = np.random.default_rng(0).normal(size=(6, 2))
    D = np.linalg.norm(pts[:, None] - pts[None], axis=-1)
    Y = classical_mds(D)
    np.testing.assert_allclose(np.linalg.norm(Y[:, None] - Y[None], axis=-1), D, atol=1e-8)


# ---- end to end on tiny random models -----------------------------------------------------------


def _loaded(model, tok, family):
    from headlab.models.loader import LoadedModel, adapt

    model.eval()
    return LoadedModel(model, tok, adapt(model), f"tiny-{family}", family, 64)


def tiny_bert():
    torch.manual_seed(0)
    tok = wordpiece()
    cfg = transformers.BertConfig(vocab_size=len(WP_VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
    return _loaded(transformers.BertModel(cfg), tok, "bert")


def tiny_llama():
    torch.manual_seed(0)
    tok = bpe()
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                   attn_implementation="eager", pad_token_id=tok.pad_token_id)
    return _loaded(transformers.LlamaForCausalLM(cfg), tok, "llama")


@pytest.mark.parametrize("make", [tiny_bert, tiny_llama])
def test_probe_end_to_end_equals_loop_over_hf_attentions(treebank, make):
    loaded = make()
    r = probe(loaded, treebank, head_map_sentences=2, grad_sentences=2)
    tb = read_treebank(treebank)
    aligned, _ = al.align_sentences(loaded.tokenizer, tb.sentences)
    rel_index = {n: i for i, n in enumerate(r.relation_names)}
    atts = []
    with torch.no_grad():
        for a in aligned:
            out = loaded.model(input_ids=torch.from_numpy(a.ids)[None], output_attentions=True)
            atts.append(torch.cat(out.attentions, 1)[0].double().numpy())  # (L*H, T, T), layer-major
    want, count = loop_scores(aligned, atts, rel_index)
    L, H = loaded.adapter.n_layers, loaded.adapter.n_heads
    np.testing.assert_allclose(r.accuracy, (want / np.maximum(count[:, None], 1)).reshape(2, L, H, -1), atol=1e-9)
    assert r.sentences == 2 and {s.sent_id for s in r.skipped} == {"s3-cycle", "s4-noroot"}
    assert r.causal is (loaded.family == "llama")
    assert r.head_map.shape == (L * H, 2)
    if r.causal:  # a decoder's dep->head for det can never be right: its head comes later
        assert r.accuracy[0, :, :, rel_index["det"]].max() == 0
        assert "next-token" in r.grad_note and np.isfinite(r.per_head["grad_sep"]).all()
    else:
        assert "not run" in r.grad_note  # a bare BertModel has no loss
        assert r.per_head["to_sep"].min() >= 0
    # round trip and the --json document
    back = ProbeResult.from_json(json.loads(json.dumps(r.to_json())))
    np.testing.assert_allclose(back.accuracy, r.accuracy, atol=1e-6)
    assert back.best_heads == [b for b in back.best_heads]
    doc = r.summary()
    assert set(doc) == {"model", "sentences", "skipped", "relations"} and doc["skipped"] == 2
    assert set(doc["relations"][0]) == {"relation", "direction", "layer", "head", "accuracy", "baseline_offset",
                                        "baseline_accuracy", "count"}


def test_unknown_relation_lists_the_known_ones(treebank):
    with pytest.raises(InputError, match=r"'poss' does not occur.*it has: .*det.*nmod:poss"):
        probe(tiny_bert(), treebank, relations="det,poss")


def test_head_annotations_from_result_and_file(tmp_path):
    acc = np.zeros((2, 1, 2, 1))
    acc[0, 0, 1, 0] = 0.78
    r = ProbeResult("m", "bert", False, "t", 1, 2, 5, 20, ["det"], acc, np.full((2, 1), 50.0), np.zeros((2, 1)),
                    np.full((2, 1), 0.41), np.ones((2, 1), dtype=int), {})
    assert head_annotations(r) == {(0, 1): "det head: 78% vs offset baseline 41%"}
    assert head_annotations(r, min_margin=0.4) == {}
    assert list(r.heads_beating_baseline()) == [(0, 1)]
    assert r.heads_beating_baseline(min_margin=0.4) == {} and r.heads_beating_baseline(min_count=51) == {}
    path = r.save_json(tmp_path / "relations.json")
    assert head_annotations(path) == {(0, 1): "det head: 78% vs offset baseline 41%"}
    with pytest.raises(InputError, match="no probe result"):
        head_annotations(tmp_path / "missing.json")


# ---- CLI ------------------------------------------------------------------------------------------


def test_cli_help(capsys):
    code, out, _ = run_cli(["probe", "--help"], capsys)
    assert code == 0 and "--treebank" in out and "--relations" in out


def test_cli_json_and_files(tmp_path, treebank, capsys):
    loaded = tiny_bert()
    folder = tmp_path / "tiny-bert"
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    code, out, err = run_cli(["probe", "--treebank", treebank, "--model", folder, "--json", "--out", tmp_path / "o"],
                             capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["sentences"] == 2 and doc["skipped"] == 2
    assert {(e["relation"], e["direction"]) for e in doc["relations"]} >= {("det", "dep->head"), ("det", "head->dep")}
    for name in ("relations.csv", "relations.json", "relations_heatmap.png", "head_map.png", "probe.html"):
        assert (tmp_path / "o" / name).stat().st_size > 0
    page = (tmp_path / "o" / "probe.html").read_text()
    assert "s3-cycle" in page and "http" not in page.split("<body>")[1]


@pytest.mark.parametrize("content, args, match", [
    ("1\tThe\n", [], "not CoNLL-U"),
    ("", [], "no sentence"),
    (CONLLU, ["--relations", "poss"], "does not occur"),
])
def test_cli_errors_exit_2(tmp_path, capsys, content, args, match):
    p = tmp_path / "x.conllu"
    p.write_text(content)
    code, _, err = run_cli(["probe", "--treebank", p, *args], capsys)
    assert code == 2 and match in err


def test_cli_missing_file_exit_2(tmp_path, capsys):
    code, _, err = run_cli(["probe", "--treebank", tmp_path / "none.conllu"], capsys)
    assert code == 2 and "no such treebank file" in err


def test_sentences_longer_than_the_positions_are_skipped_and_counted(treebank):
    aligned, skipped = al.align_sentences(wordpiece(), read_treebank(treebank).sentences, max_positions=10)
    assert [a.sentence.sent_id for a in aligned] == ["s2"]
    assert skipped == [("s1", "16 tokens, more than the model's 10 positions")]


def test_gradient_test_equals_autograd_through_hf_attentions(treebank):
    """|d loss / d attention| on the first token (the decoder's sink) against the rest, per head, equals
    autograd through Hugging Face's own eager attention weights, sentence by sentence."""
    loaded = tiny_llama()
    r = probe(loaded, treebank, head_map_sentences=0, grad_sentences=2)
    aligned, _ = al.align_sentences(loaded.tokenizer, read_treebank(treebank).sentences)
    L, H = loaded.adapter.n_layers, loaded.adapter.n_heads
    sums, counts = np.zeros((2, L * H)), np.zeros(2)
    for a in aligned:
        ids = torch.from_numpy(a.ids)[None]
        out = loaded.model(input_ids=ids, output_attentions=True)
        loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:])
        grads = torch.autograd.grad(loss, out.attentions)
        g = torch.cat(grads, 1)[0].abs().double().numpy()  # (L*H, T, T)
        T = g.shape[-1]
        causal = np.tril(np.ones((T, T), dtype=bool))
        sink = causal.copy()
        sink[:, 1:] = False
        other = causal & ~sink
        sums[0] += g[:, sink].sum(-1)
        sums[1] += g[:, other].sum(-1)
        counts += (sink.sum(), other.sum())
    np.testing.assert_allclose(r.per_head["grad_sep"].ravel(), sums[0] / counts[0], rtol=1e-4)
    np.testing.assert_allclose(r.per_head["grad_other"].ravel(), sums[1] / counts[1], rtol=1e-4)
    np.testing.assert_allclose(r.per_head["grad_first"], r.per_head["grad_sep"], rtol=1e-6)  # decoder: the same sink


def test_classifier_loss_model_for_a_bare_encoder(treebank):
    loaded = tiny_bert()
    torch.manual_seed(1)
    clf = transformers.BertForSequenceClassification(loaded.model.config)
    clf_loaded = _loaded(clf, loaded.tokenizer, "bert")
    r = probe(loaded, treebank, head_map_sentences=0, grad_sentences=2, loss_model=clf_loaded)
    assert "own predicted label" in r.grad_note
    assert np.isfinite(r.per_head["grad_sep"]).all() and (r.per_head["grad_other"] > 0).all()
    assert (r.per_head["grad_first"] > 0).all()
    with pytest.raises(ModelError, match="no LM or classification head"):
        probe(loaded, treebank, grad_sentences=2, loss_model=loaded)
