"""The report: the per-head table (by hand on toy maps), the labels (on synthetic maps), the writers,
the HTML page, and `analyze` end to end on the real MiniLM (full maps and streaming statistics agree)."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from html.parser import HTMLParser

import numpy as np
import pytest

import headlab
from headlab.errors import InputError, ModelError, ShapeError, UnknownBackendError
from headlab.interpret.heads.labels import (
    LabelThresholds,
    head_records,
    row_stats_from_attention_stats,
    row_stats_from_maps,
)
from headlab.interpret.report.analyze_job import analyze, default_drawn_heads, parse_heads, write_csv, write_json
from headlab.interpret.report.html import render_html

TEXT = "The cat sat on the mat because it was tired."


# ---- the table, by hand ---------------------------------------------------------------------------


def test_table_statistics_by_hand():
    # one layer, two heads, 3 tokens: [CLS] a [SEP]
    P = np.array([
        [[0.5, 0.25, 0.25], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]],
        [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.5, 0.5]],
    ])
    tokens = ["[CLS]", "a", "[SEP]"]
    rec = head_records([row_stats_from_maps(P, sink_positions=[0, 2])], tokens, separator_positions=[2])
    assert [(r.layer, r.head) for r in rec] == [(0, 0), (0, 1)]
    for h, r in enumerate(rec):
        A = P[h]
        ent = [-sum(p * math.log(p) for p in row if p > 0) for row in A]
        dist = [sum(A[i, j] * abs(i - j) for j in range(3)) for i in range(3)]
        assert r.entropy == pytest.approx(np.mean(ent))
        assert r.norm_entropy == pytest.approx(np.mean(ent) / math.log(3))
        assert r.mean_distance == pytest.approx(np.mean(dist))
        assert r.confidence == pytest.approx(A.max(1).mean())
        assert r.mass_first == pytest.approx(A[:, 0].mean())
        assert r.mass_sep == pytest.approx(A[:, 2].mean())
        col = A.sum(0)
        assert r.top_token_pos == int(np.argmax(col)) and r.top_token == tokens[r.top_token_pos]
        assert r.top_token_share == pytest.approx(col.max() / 3)
        assert r.top_content_pos == 1 and r.top_content_share == pytest.approx(col[1] / 3)
        am = A.argmax(1)
        assert r.prev_share == pytest.approx(np.mean([am[i] == i - 1 for i in (1, 2)]))
        assert r.next_share == pytest.approx(np.mean([am[i] == i + 1 for i in (0, 1)]))
        assert r.self_share == pytest.approx(np.mean([am[i] == i for i in range(3)]))
    assert rec[1].next_share == 0.5 and rec[1].self_share == pytest.approx(1 / 3)


def _map(kind: str, n: int) -> np.ndarray:
    """A synthetic (n, n) map of one pattern."""
    P = np.zeros((n, n))
    for i in range(n):
        if kind == "previous":
            P[i, max(i - 1, 0)] = 1.0
        elif kind == "next":
            P[i, min(i + 1, n - 1)] = 1.0
        elif kind == "self":
            P[i, i] = 1.0
        elif kind == "sink":
            P[i] = 0.2 / (n - 1)
            P[i, 0] = 0.8
        elif kind == "uniform":
            P[i] = 1.0 / n
        elif kind == "noisy-previous":  # 70% on i-1, the rest spread
            P[i] = 0.3 / n
            P[i, max(i - 1, 0)] += 0.7
        elif kind == "spread-two":  # half on self, half on the last token: no label
            P[i, i] += 0.5
            P[i, 3] += 0.5
    return P


@dataclass(frozen=True)
class LabelCase:
    kind: str
    labels: tuple[str, ...]
    evidence_start: str


LABEL_CASES = [
    LabelCase("previous", ("previous-token",), "previous-token: 100% of rows argmax at offset -1 (9 of 9 rows)"),
    LabelCase("next", ("next-token",), "next-token: 100% of rows argmax at offset +1 (9 of 9 rows)"),
    LabelCase("self", ("self",), "self: 100% of rows argmax at offset 0 (10 of 10 rows)"),
    LabelCase("sink", ("separator-sink",), "separator-sink: mean 80% of each row's weight on the first token"),
    LabelCase("uniform", ("broad",), "broad: mean normalised entropy 1.00"),
    LabelCase("noisy-previous", ("previous-token",), "previous-token: 100% of rows argmax at offset -1"),
    LabelCase("spread-two", (), ""),
]


@pytest.mark.parametrize("case", LABEL_CASES, ids=lambda c: c.kind)
def test_labels_on_synthetic_maps(case):
    n = 10
    rows = row_stats_from_maps(_map(case.kind, n)[None], sink_positions=[0])
    rec = head_records([rows], [f"t{i}" for i in range(n)], separator_positions=None)[0]
    assert rec.labels == case.labels
    assert len(rec.evidence) == len(rec.labels)
    if case.labels:
        assert rec.evidence[0].startswith(case.evidence_start)
    assert rec.mass_sep is None  # decoder-style: no separators


def test_thresholds_move_labels():
    rows = row_stats_from_maps(_map("sink", 10)[None], sink_positions=[0])
    assert head_records([rows], list("abcdefghij"), separator_positions=None,
                        thresholds=LabelThresholds(sink=0.9))[0].labels == ()


def test_causal_rows_see_fewer_keys():
    # a causal uniform map: row i spreads over i + 1 keys; normalised entropy is 1 on every row
    n = 6
    P = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    rec = head_records([row_stats_from_maps(P[None], sink_positions=[0], causal=True)], list("abcdef"),
                       separator_positions=None)[0]
    assert rec.norm_entropy == pytest.approx(1.0)
    assert rec.next_share == 0.0 and "broad" in rec.labels


def test_streaming_rows_equal_map_rows():
    import torch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 23, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 23, 16, generator=g, dtype=torch.float64)
    for causal in (False, True):
        W = headlab.attention_weights(q, k, causal=causal)[0]  # (H, L, L)
        tokens = [f"t{i}" for i in range(23)]
        seps = None if causal else [11, 22]
        sink = [0] + (seps or [])
        a = head_records([row_stats_from_maps(W, sink_positions=sink, causal=causal)], tokens, separator_positions=seps)
        st = headlab.attention_stats(q, k, causal=causal, key_positions=sink)
        b = head_records([row_stats_from_attention_stats(st, sink_positions=sink, causal=causal)], tokens,
                         separator_positions=seps)
        for x, y in zip(a, b):
            for name in ("entropy", "norm_entropy", "mean_distance", "confidence", "mass_first", "prev_share",
                         "self_share", "top_token_share"):
                assert getattr(x, name) == pytest.approx(getattr(y, name), abs=1e-9), name
            assert (x.labels, x.top_token_pos) == (y.labels, y.top_token_pos)


def test_shape_errors():
    with pytest.raises(ShapeError, match=r"\(heads, q_len, k_len\)"):
        row_stats_from_maps(np.ones((3, 3)), sink_positions=[0])
    rows = row_stats_from_maps(np.full((1, 3, 3), 1 / 3), sink_positions=[0])
    with pytest.raises(ShapeError, match="token strings"):
        head_records([rows], ["a", "b"], separator_positions=None)
    with pytest.raises(ShapeError, match="sink positions"):
        head_records([rows], ["a", "b", "c"], separator_positions=[2])


def test_parse_heads_and_default_drawn():
    assert parse_heads("1.2,0.3,1.2", 2, 4) == [(1, 2), (0, 3)]
    for bad, msg in (("x", "LAYER.HEAD"), ("1.9", "does not exist"), (" , ", "no heads")):
        with pytest.raises(InputError, match=msg):
            parse_heads(bad, 2, 4)
    maps = np.stack([_map("uniform", 8), _map("previous", 8), _map("sink", 8), _map("self", 8)])
    recs = head_records([row_stats_from_maps(maps, sink_positions=[0])], list("abcdefgh"), separator_positions=None)
    assert default_drawn_heads(recs, 2) == [(0, 1), (0, 3)]


def test_writers_round_trip(tmp_path):
    maps = np.stack([_map("previous", 5), _map("uniform", 5)])
    recs = head_records([row_stats_from_maps(maps, sink_positions=[0, 4])], list("abcde"), separator_positions=[4])
    write_csv(recs, tmp_path / "h.csv")
    write_json(recs, tmp_path / "h.json", model="toy")
    rows = list(csv.DictReader((tmp_path / "h.csv").open()))
    js = json.loads((tmp_path / "h.json").read_text())
    assert js["model"] == "toy" and len(rows) == len(js["heads"]) == 2
    for row, obj, rec in zip(rows, js["heads"], recs):
        assert float(row["entropy"]) == pytest.approx(obj["entropy"]) == pytest.approx(rec.entropy)
        assert row["labels"].split(";") == obj["labels"] == list(rec.labels)


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.heads, self.scripts, self.external, self.data = set(), 0, [], None
        self._in_data = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-layer" in a and "data-head" in a and tag == "button":
            self.heads.add((int(a["data-layer"]), int(a["data-head"])))
        if tag == "script":
            self.scripts += 1
            self._in_data = a.get("id") == "headlab-data"
            if "src" in a:
                self.external.append(a["src"])
        if tag == "link" or (tag in ("img", "iframe") and "src" in a):
            self.external.append(a.get("href") or a.get("src"))

    def handle_data(self, data):
        if self._in_data:
            self.data = (self.data or "") + data

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_data = False


def parse_page(text: str) -> _Collect:
    p = _Collect()
    p.feed(text)
    return p


def test_html_escapes_tokens():
    tokens = ["</script>", "<b>&", "x"]
    P = np.full((1, 3, 3), 1 / 3)
    recs = head_records([row_stats_from_maps(P, sink_positions=[0])], tokens, separator_positions=None)
    page = render_html(title="<t>", tokens=tokens, records=recs, maps={(0, 0): P[0]}, n_layers=1, n_heads=1)
    p = parse_page(page)
    assert json.loads(p.data)["tokens"] == tokens  # the data survived the HTML parser intact
    assert "<t>" not in page and p.heads == {(0, 0)}
    with pytest.raises(ShapeError):
        render_html(title="t", tokens=tokens, records=recs, maps={(0, 0): P[0, :2]}, n_layers=1, n_heads=1)


# ---- the real model, end to end ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    return headlab.load("minilm")


@pytest.fixture(scope="module")
def full_report(minilm, tmp_path_factory):
    return analyze(TEXT, model=minilm, out_dir=tmp_path_factory.mktemp("full") / "report")


def test_analyze_end_to_end(full_report, minilm):
    r = full_report
    L, H = minilm.adapter.n_layers, minilm.adapter.n_heads
    assert r.mode == "full" and r.tokens[0] == "[CLS]" and r.tokens[-1] == "[SEP]"
    assert len(r.records) == L * H and len(r.drawn) == L * H
    assert [p.name for p in r.pngs] == [f"layer_{i:02d}.png" for i in range(L)]
    for p in r.pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    page = parse_page(r.html.read_text(encoding="utf-8"))
    assert page.heads == {(i, h) for i in range(L) for h in range(H)}
    assert page.external == []  # nothing loaded from anywhere: self-contained
    data = json.loads(page.data)
    assert set(data["maps"]) == {f"{i}.{h}" for i in range(L) for h in range(H)}
    assert data["tokens"] == r.tokens
    # CSV and JSON say the same, and agree with the result object
    js = json.loads(r.json.read_text())
    rows = list(csv.DictReader(r.csv.open()))
    assert js["tokens"] == r.tokens and js["mode"] == "full" and len(js["heads"]) == len(rows) == L * H
    for row, obj, rec in zip(rows, js["heads"], r.records):
        assert (int(row["layer"]), int(row["head"])) == (obj["layer"], obj["head"]) == (rec.layer, rec.head)
        for name in ("entropy", "mean_distance", "mass_first", "mass_sep", "prev_share"):
            assert float(row[name]) == pytest.approx(obj[name]) == pytest.approx(getattr(rec, name))
        assert row["top_token"] == obj["top_token"] == rec.top_token
        assert [x for x in row["labels"].split(";") if x] == obj["labels"]


def test_analyze_table_matches_capture(full_report, minilm):
    # recompute two heads' numbers straight from the captured maps
    inputs = minilm.encode(TEXT)
    cache = headlab.capture(minilm, inputs, sites=["blocks.0.attn.pattern", "blocks.4.attn.pattern"])
    for layer, head in ((0, 2), (4, 5)):
        A = cache[f"blocks.{layer}.attn.pattern"][0, head].double().numpy()
        rec = full_report.record(layer, head)
        n = A.shape[0]
        assert rec.mass_first == pytest.approx(A[:, 0].mean(), abs=1e-6)
        assert rec.mass_sep == pytest.approx(A[:, n - 1].mean(), abs=1e-6)
        assert rec.mean_distance == pytest.approx((A * np.abs(np.subtract.outer(range(n), range(n)))).sum(1).mean(),
                                                  abs=1e-5)
        assert rec.prev_share == pytest.approx(np.mean(A[1:].argmax(1) == np.arange(n - 1)))


def test_minilm_has_a_previous_token_head(full_report):
    # MiniLM layer 0 head 2 looks at the previous token (seen on every text tried); the label must say so
    rec = full_report.record(0, 2)
    assert "previous-token" in rec.labels and rec.prev_share > 0.9
    assert ("previous-token", rec) in full_report.interesting()


def test_streaming_mode_matches_full(full_report, minilm, tmp_path):
    out = tmp_path / "stream"
    out.mkdir()
    (out / "layer_05.png").write_bytes(b"stale")
    (out / "mine.txt").write_text("not a report file")
    s = analyze(TEXT, model=minilm, out_dir=out, force=True, max_full_tokens=4, heads="0.2,4.5")
    assert s.mode == "streaming" and s.drawn == [(0, 2), (4, 5)]
    assert any("streaming statistics" in n for n in s.notes)
    assert sorted(p.name for p in out.iterdir()) == ["heads.csv", "heads.json", "layer_00.png", "layer_04.png",
                                                      "mine.txt", "report.html"]
    for a, b in zip(full_report.records, s.records):
        for name in ("entropy", "norm_entropy", "mean_distance", "confidence", "mass_first", "mass_sep",
                     "prev_share", "next_share", "self_share", "top_token_share"):
            assert getattr(b, name) == pytest.approx(getattr(a, name), abs=2e-4), (a.layer, a.head, name)
        assert (a.labels, a.top_token_pos) == (b.labels, b.top_token_pos)
    page = s.html.read_text(encoding="utf-8")
    data = json.loads(parse_page(page).data)
    assert set(data["maps"]) == {"0.2", "4.5"} and "streaming statistics" in page
    # the drawn maps are the model's own maps
    full = json.loads(parse_page(full_report.html.read_text(encoding="utf-8")).data)
    assert _close_b64(data["maps"]["4.5"], full["maps"]["4.5"])


def _close_b64(a: str, b: str) -> bool:
    import base64

    x = np.frombuffer(base64.b64decode(a), "<u2").astype(int)
    y = np.frombuffer(base64.b64decode(b), "<u2").astype(int)
    return x.shape == y.shape and np.abs(x - y).max() <= 2


@dataclass(frozen=True)
class BadCase:
    name: str
    kwargs: dict
    error: type
    match: str


BAD_INPUTS = [
    BadCase("empty text", {"text": "   "}, InputError, "empty"),
    BadCase("unknown model", {"model": "no-such-model"}, ModelError, "known names: minilm"),
    BadCase("unknown backend", {"backend": "warp"}, UnknownBackendError, "warp"),
    BadCase("bad heads", {"heads": "0.99"}, InputError, "does not exist"),
    BadCase("too long", {"text": "word " * 600}, InputError, "at most 512"),
    BadCase("max_full_tokens", {"max_full_tokens": 0}, InputError, "at least 1"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c.name)
def test_bad_input(case, minilm, tmp_path):
    kw = {"text": TEXT, "model": minilm, "out_dir": tmp_path / "out", **case.kwargs}
    with pytest.raises(case.error, match=case.match):
        analyze(kw.pop("text"), **kw)


def test_not_a_model_folder_and_busy_output(tmp_path, minilm):
    folder = tmp_path / "notamodel"
    folder.mkdir()
    (folder / "readme.txt").write_text("hello")
    with pytest.raises(ModelError, match="not a Hugging Face model folder"):
        analyze(TEXT, model=str(folder), out_dir=tmp_path / "o1")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(InputError, match="not empty.*--force"):
        analyze(TEXT, model=minilm, out_dir=busy)
    with pytest.raises(InputError, match="is a file"):
        analyze(TEXT, model=minilm, out_dir=busy / "x")


def test_truncation_is_said(minilm, tmp_path):
    r = analyze("word " * 600, model=minilm, out_dir=tmp_path / "t", truncate=True, max_full_tokens=8, heads="0.2")
    assert len(r.tokens) == 512 and any("truncated" in n for n in r.notes)
    assert "truncated" in r.html.read_text(encoding="utf-8")


def test_decoder_from_a_local_folder(minilm, tmp_path):
    # a tiny random GPT-2 saved as a Hugging Face folder (with MiniLM's tokenizer): causal rows,
    # the first token as the sink, no separators; streaming statistics equal the full maps' numbers
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(minilm.tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(folder)
    minilm.tokenizer.save_pretrained(folder)
    full = analyze(TEXT, model=str(folder), out_dir=tmp_path / "full")
    assert full.family == "gpt2" and full.mode == "full" and len(full.pngs) == 2
    assert all(r.mass_sep is None and r.next_share == 0.0 for r in full.records)
    js = json.loads(full.json.read_text())
    assert js["causal"] is True and js["separator_positions"] is None
    assert "mass first token" in full.html.read_text(encoding="utf-8")
    stream = analyze(TEXT, model=str(folder), out_dir=tmp_path / "stream", max_full_tokens=3, heads="1.3")
    assert stream.mode == "streaming" and [p.name for p in stream.pngs] == ["layer_01.png"]
    for a, b in zip(full.records, stream.records):
        for name in ("entropy", "norm_entropy", "mean_distance", "confidence", "mass_first", "prev_share", "self_share"):
            assert getattr(b, name) == pytest.approx(getattr(a, name), abs=2e-4), (a.layer, a.head, name)
        assert a.labels == b.labels
    data = json.loads(parse_page(stream.html.read_text(encoding="utf-8")).data)
    full_data = json.loads(parse_page(full.html.read_text(encoding="utf-8")).data)
    assert _close_b64(data["maps"]["1.3"], full_data["maps"]["1.3"])


@pytest.mark.parametrize("arch", ["mistral-sliding-window", "gpt2-layer-scaling"])
def test_streaming_pictures_are_what_the_model_computed(arch, minilm, tmp_path):
    """Drawn maps in streaming mode use the layer's own mask and scale (a sliding window, GPT-2's
    scale_attn_by_inverse_layer_idx), so they equal the full maps the model computed."""
    import torch
    import transformers

    torch.manual_seed(0)
    V = len(minilm.tokenizer)
    if arch.startswith("mistral"):
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=64, sliding_window=3))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, scale_attn_by_inverse_layer_idx=True))
    folder = tmp_path / arch
    model.save_pretrained(folder)
    minilm.tokenizer.save_pretrained(folder)
    full = analyze(TEXT, model=str(folder), out_dir=tmp_path / "full")
    stream = analyze(TEXT, model=str(folder), out_dir=tmp_path / "stream", max_full_tokens=3, heads="1.1")
    data = json.loads(parse_page(stream.html.read_text(encoding="utf-8")).data)
    full_data = json.loads(parse_page(full.html.read_text(encoding="utf-8")).data)
    assert _close_b64(data["maps"]["1.1"], full_data["maps"]["1.1"])


def test_other_studies_annotate_heads(minilm, tmp_path):
    from headlab.errors import InputError
    from headlab.interpret.report.annotations import study_annotations

    heads_file = tmp_path / "importance.json"
    grid = [[float(l * 12 + h) for h in range(12)] for l in range(6)]
    heads_file.write_text(json.dumps({"importance": grid, "verdicts": [{"layer": 5, "head": 11, "label": "unique"}]}))
    notes = study_annotations(heads=heads_file)
    assert notes[(5, 11)] == ["importance 71 (rank 1/72); unique"]
    r = analyze(TEXT, model=minilm, out_dir=tmp_path / "a", annotations={**notes, (0, 2): "det head: 78% vs 41%"})
    rec = {(x["layer"], x["head"]): x for x in json.loads(r.json.read_text())["heads"]}
    assert rec[(0, 2)]["notes"] == ["det head: 78% vs 41%"] and rec[(5, 11)]["notes"][0].startswith("importance 71")
    page = r.html.read_text(encoding="utf-8")
    assert "other studies" in page and "det head: 78% vs 41%" in page
    with pytest.raises(InputError, match="does not have"):
        analyze(TEXT, model=minilm, out_dir=tmp_path / "b", annotations={(9, 0): "x"})
    with pytest.raises(InputError, match="no such file"):
        study_annotations(probe=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(InputError, match="not a headlab heads result"):
        study_annotations(heads=bad)
