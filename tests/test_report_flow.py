"""The analyze page's norm maps and rollout view, against independent computations on a tiny random BERT built
inline (bundled MiniLM tokenizer): the value norms in the page's data against ||f_h(x_j)|| from the model's own
projection weights, the norm map the page draws (weight map x value norms) against ||a_ij f_h(x_j)|| from
Hugging Face's eager maps, and the rollout map or rows against a numpy product of 0.5 mean_h(A) + 0.5 I."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from headlab.interpret.report.analyze_job import analyze
from headlab.models import adapt
from headlab.models.loader import LoadedModel

import transformers

TEXT = "The cat sat on the mat because it was tired."


@pytest.fixture(scope="module")
def bert():
    from headlab.models.named_models import minilm_dir

    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    torch.manual_seed(0)
    m = transformers.BertModel(transformers.BertConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, attn_implementation="eager")).eval()
    with torch.no_grad():  # peaked maps and value norms that differ between tokens
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    a = adapt(m)
    return LoadedModel(m, tok, a, "tiny-bert", a.family, 64)


def _reference(loaded):
    """Per layer: eager maps (H, n, n), value norms ||f_h(x_j)|| (H, n) and norm maps ||a_ij f_h(x_j)|| (H, n, n)."""
    m = loaded.model
    enc = loaded.encode(TEXT)
    with torch.no_grad():
        out = m(**enc, output_attentions=True, output_hidden_states=True)
        maps, vnorms, nmaps = [], [], []
        for l, A in enumerate(out.attentions):
            att = m.encoder.layer[l].attention
            x = out.hidden_states[l][0]  # post-LN BERT: the layer input is the attention's input
            H = m.config.num_attention_heads
            d = m.config.hidden_size // H
            v = att.self.value(x).view(x.shape[0], H, d)  # (n, H, d)
            wo = att.output.dense.weight  # (E, H d)
            f = torch.stack([v[:, h] @ wo[:, h * d:(h + 1) * d].T for h in range(H)])  # (H, n, E)
            maps.append(A[0].double().numpy())
            vnorms.append(f.norm(dim=-1).double().numpy())
            nmaps.append((A[0].unsqueeze(-1) * f.unsqueeze(1)).norm(dim=-1).double().numpy())  # (H, n, n)
    return maps, vnorms, nmaps


def _rollout(maps) -> np.ndarray:
    R = np.eye(maps[0].shape[-1])
    for A in maps:
        Ah = 0.5 * A.mean(0) + 0.5 * np.eye(A.shape[-1])
        R = (Ah / Ah.sum(-1, keepdims=True)) @ R
    return R


def _page_data(path) -> dict:
    page = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="headlab-data">(.*?)</script>', page, re.S).group(1))


def _decode(b64: str, n: int) -> np.ndarray:
    import base64

    return np.frombuffer(base64.b64decode(b64), dtype="<u2").astype(np.float64).reshape(n, n) / 65535


def test_page_norm_maps_and_rollout_map_equal_independent_computations(bert, tmp_path):
    r = analyze(TEXT, model=bert, out_dir=tmp_path / "rep")
    page = r.html.read_text(encoding="utf-8")
    assert 'id="normmap"' in page and 'id="rollout-section"' in page and "Kobayashi et al. 2020" in page
    data = _page_data(r.html)
    maps, vnorms, nmaps = _reference(bert)
    n = len(r.tokens)
    flow = data["flow"]
    assert set(flow["value_norms"]) == {f"{l}.{h}" for l in range(2) for h in range(4)}
    for key, vn in flow["value_norms"].items():
        l, h = map(int, key.split("."))
        np.testing.assert_allclose(vn, vnorms[l][h], rtol=1e-6)  # the page's numbers: ||f_h(x_j)||
        N = _decode(data["maps"][key], n) * np.asarray(vn)[None, :]  # what the page draws: a_ij ||f_h(x_j)||
        np.testing.assert_allclose(N, nmaps[l][h], rtol=0, atol=1e-5 * vnorms[l][h].max())
    want = _rollout(maps)
    np.testing.assert_allclose(_decode(flow["rollout"]["map"], n), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(flow["rollout"]["rows"]["0"], want[0], rtol=1e-6)
    assert flow["rollout"]["layer"] == 1 and not (tmp_path / "rep" / "rollout.png").exists()  # files only with --flow


def test_long_input_page_has_rollout_rows_and_says_so(bert, tmp_path):
    r = analyze(TEXT, model=bert, out_dir=tmp_path / "long", max_full_tokens=4, heads="1.2,0.3")
    assert r.mode == "streaming"
    n = len(r.tokens)
    flow = _page_data(r.html)["flow"]
    assert "map" not in flow["rollout"] and set(flow["rollout"]["rows"]) == {"0", str(n - 1)}
    note = flow["rollout"]["note"]
    assert "rows only" in note and "past the full-map length" in note and f"{n} tokens > 4" in note
    maps, vnorms, _ = _reference(bert)
    want = _rollout(maps)
    for pos, row in flow["rollout"]["rows"].items():
        np.testing.assert_allclose(row, want[int(pos)], rtol=1e-5, atol=1e-7)  # float32 kernels
    assert set(flow["value_norms"]) == {"1.2", "0.3"}  # the drawn heads only
    np.testing.assert_allclose(flow["value_norms"]["1.2"], vnorms[1][2], rtol=1e-6)


def test_flow_option_writes_the_files_too(bert, tmp_path):
    r = analyze(TEXT, model=bert, out_dir=tmp_path / "f", flow=True)
    names = {p.name for p in r.out_dir.iterdir()}
    assert {"rollout.png", "rollout.json", "norms_layer_00.png", "norms_layer_01.png"} <= names
    rows = json.loads((r.out_dir / "rollout.json").read_text())["rows"]
    page_rows = _page_data(r.html)["flow"]["rollout"]["rows"]
    assert rows.keys() == page_rows.keys()
    np.testing.assert_allclose(rows["0"], page_rows["0"], rtol=1e-6)


def test_no_norm_maps_without_the_weights_says_why(bert, tmp_path, monkeypatch):
    def missing(layer):
        raise NotImplementedError("this adapter does not give W_V")

    monkeypatch.setattr(bert.adapter, "W_V", missing)
    r = analyze(TEXT, model=bert, out_dir=tmp_path / "nowv")
    assert _page_data(r.html)["flow"] is None
    assert any("norm maps and rollout are left out" in n and "W_V" in n for n in r.notes)
    assert "norm maps and rollout are left out" in r.html.read_text(encoding="utf-8")  # the page's banner


def test_an_approximate_backend_in_streaming_mode_leaves_them_out(bert, tmp_path):
    r = analyze(TEXT, model=bert, out_dir=tmp_path / "lin", backend="linear", max_full_tokens=4, heads="0.1")
    assert _page_data(r.html)["flow"] is None
    assert any("'linear' is approximate" in n and "norm maps and rollout" in n for n in r.notes)
    full = analyze(TEXT, model=bert, out_dir=tmp_path / "lin-full", backend="linear")  # maps are exact: so are they
    maps, vnorms, _ = _reference(bert)
    np.testing.assert_allclose(_page_data(full.html)["flow"]["value_norms"]["0.1"], vnorms[0][1], rtol=1e-6)


def test_flow_rows_of_the_wrong_length_are_refused():
    from headlab.errors import ShapeError
    from headlab.interpret.heads.labels import head_records, row_stats_from_maps
    from headlab.interpret.report.html import render_html

    P = np.full((1, 2, 2), 0.5)
    recs = head_records([row_stats_from_maps(P, sink_positions=[0])], ["a", "b"], separator_positions=None)
    with pytest.raises(ShapeError, match="3 values for 2 tokens"):
        render_html(title="t", tokens=["a", "b"], records=recs, maps={(0, 0): P[0]}, n_layers=1, n_heads=1,
                    flow={"value_norms": {"0.0": [1.0, 2.0, 3.0]}, "rollout": {"rows": {}}})


@pytest.mark.parametrize("max_full", [256, 4], ids=["full", "streaming"])
def test_analyze_runs_the_model_once_for_maps_norms_and_rollout(bert, tmp_path, max_full):
    """Record once: the table, the value norms and the rollout all come from one forward of the model (a model
    without a task head, so no saliency section runs its own gradient passes); before, full mode ran it three
    times. The page still carries the norms and the rollout. (The atlas section runs the atlas's own small
    inputs, not the text: the heads' roles belong to the model; those forwards are not counted.)"""
    text_ids = bert.encode(TEXT)["input_ids"]
    calls = []

    def on_text(mod, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.shape == text_ids.shape and torch.equal(ids, text_ids):
            calls.append(1)

    handle = bert.model.register_forward_pre_hook(on_text, with_kwargs=True)
    try:
        r = analyze(TEXT, model=bert, out_dir=tmp_path / "out", max_full_tokens=max_full, flow=True)
    finally:
        handle.remove()
    assert len(calls) == 1, f"the model ran {len(calls)} times on the text"
    data = json.loads(re.search(r'<script type="application/json" id="headlab-data">(.*?)</script>',
                                r.html.read_text(), re.S).group(1))
    assert data["flow"]["value_norms"] and data["flow"]["rollout"]["rows"]
    assert (tmp_path / "out" / "rollout.json").is_file()


def test_a_section_is_one_class_and_its_registration(bert, tmp_path):
    """A new section (its sites asked up front, its result from the one recording, its HTML and data in the page)
    needs nothing but its class and its registration."""
    from headlab.interpret.report.sections import base

    class Widths(base.Section):
        name = "widths_test"

        def sites(self, job):
            return job.adapter.sites("input")

        def compute(self, job, cache, results):
            return [float(cache[job.adapter.site_name(l, "input")].norm()) for l in range(job.adapter.n_layers)]

        def page(self, job, result, results):
            return base.PagePart(html=f'<section id="widths-test">{len(result)} layers</section>',
                                 data={"widths_test": result}, notes=["widths: a test section"])

    base.register(Widths)
    try:
        r = analyze(TEXT, model=bert, out_dir=tmp_path / "out")
    finally:
        base._SECTIONS[:] = [s for s in base._SECTIONS if s.name != "widths_test"]
    page = r.html.read_text()
    assert '<section id="widths-test">2 layers</section>' in page
    data = json.loads(re.search(r'id="headlab-data">(.*?)</script>', page, re.S).group(1))
    with torch.no_grad():
        x0 = bert.model(**bert.encode(TEXT), output_hidden_states=True).hidden_states[0]
    assert data["widths_test"][0] == pytest.approx(float(x0.norm()), rel=1e-5)
    assert "widths: a test section" in r.notes
    with pytest.raises(TypeError, match="already registered"):
        base.register(type("Again", (base.Section,), {"name": "heads"}))
