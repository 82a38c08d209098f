"""``headlab atlas``: --help, errors exit 2 with one line before any model work, and an end-to-end run on a tiny
saved decoder that writes atlas.json (readable by ``Atlas.from_json``) and atlas.html."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import run_cli
from headlab.interpret.atlas import Atlas
from headlab.models.transformer import Transformer, TransformerConfig


@pytest.fixture()
def saved_decoder(tmp_path):
    torch.manual_seed(1)
    m = Transformer(TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True))
    return m.eval().save(tmp_path / "tiny")


def test_help_and_errors(tmp_path, saved_decoder, capsys):
    code, so, _ = run_cli(["atlas", "--help"], capsys)
    assert code == 0 and "--kinds" in so and "--out" in so
    code, _, se = run_cli(["atlas", "--model", saved_decoder, "--kinds", "induktion", "--out", tmp_path / "o"], capsys)
    assert code == 2 and "induktion" in se and len(se.strip().splitlines()) == 1
    code, _, se = run_cli(["atlas", "--model", saved_decoder, "--texts", tmp_path / "none.txt", "--out", tmp_path / "o"],
                          capsys)
    assert code == 2 and "does not exist" in se
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    code, _, se = run_cli(["atlas", "--model", saved_decoder, "--out", busy], capsys)
    assert code == 2 and "not empty" in se


def test_end_to_end(tmp_path, saved_decoder, capsys):
    texts = tmp_path / "ids.txt"
    g = torch.Generator().manual_seed(0)
    texts.write_text("\n".join(" ".join(str(int(x)) for x in torch.randint(1, 40, (40,), generator=g))
                               for _ in range(4)) + "\n")
    out = tmp_path / "out"
    code, so, se = run_cli(["atlas", "--model", saved_decoder, "--texts", texts, "--out", out, "--half", "6",
                            "--max-tokens", "24", "--n-texts", "3", "--needles", "2", "--haystack", "30",
                            "--top-k", "2", "--json"], capsys)
    assert code == 0, se
    summary = json.loads(so)
    assert set(summary) == {"previous_token", "duplicate_token", "induction", "retrieval", "sink", "local"}
    a = Atlas.from_json(out / "atlas.json")
    assert a.n_heads == 4 and a.n_kv_heads == 2 and set(a.verdicts) == set(summary)
    assert all(summary[k]["verdict"] == a.verdicts[k]["verdict"] for k in summary)
    page = (out / "atlas.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and 'data-grid="roles"' in page


def test_analyze_report_lists_the_atlas_roles(tmp_path):
    # the report's atlas section against scores computed here from Hugging Face's own eager attention maps
    # (a fresh copy of the model, output_attentions=True), each by its kind's published definition, on the
    # section's documented inputs: 2 sequences of 16 random tokens repeated once, one 64-token piece of the
    # shipped passage; a head carries a role at or above the documented threshold
    import html as H

    import transformers

    import headlab
    from headlab.interpret.atlas import tasks as T
    from headlab.interpret.report.analyze_job import analyze
    from headlab.models.named_models import minilm_dir

    ld = headlab.load("minilm")
    analyze("The cat sat on the mat.", model=ld, out_dir=tmp_path / "r")
    page = (tmp_path / "r" / "report.html").read_text()
    assert 'id="atlas-section"' in page
    tok = ld.tokenizer
    eager = transformers.AutoModel.from_pretrained(minilm_dir(), attn_implementation="eager").eval()

    def maps(ids):  # (B, layers, heads, T, T), float64
        with torch.no_grad():
            return torch.stack(eager(ids, attention_mask=torch.ones_like(ids), output_attentions=True).attentions,
                               1).double()

    half = 16
    rep, start = T.repeated(tok, vocab=tok.vocab_size, n=2, half=half, seed=0)
    assert rep.shape == (2, 2 * half + 2) and start == 1 and (rep[:, 0] == tok.cls_token_id).all()
    assert (rep[:, -1] == tok.sep_token_id).all() and (rep[:, 1:1 + half] == rep[:, 1 + half:1 + 2 * half]).all()
    a = maps(rep)
    second = torch.arange(start + half, start + 2 * half)  # the second copy's rows
    rows = torch.arange(1, start + 2 * half)  # every row with a previous token, [CLS] and both copies
    want = {"previous_token": a[..., rows, rows - 1].mean((0, -1)),  # A[i, i-1]
            "duplicate_token": a[..., second, second - half].mean((0, -1)),  # A[i, i-T]: the earlier copy
            "induction": a[..., second, second - half + 1].mean((0, -1))}  # A[i, i-T+1]: the token after it
    text = T.natural(tok, None, max_tokens=64, n=1)[0]
    assert len(text) == 64 and tok.decode(text[1:6]).lower() in T.haystack_text().lower()
    m = maps(text[None])[0]  # (layers, heads, T, T)
    sinks = [0] + [j for j, t in enumerate(text.tolist()) if t == tok.sep_token_id]  # [CLS] and every [SEP]
    want["sink"] = m[..., sinks].sum(-1).mean(-1)
    i, j = torch.arange(64)[:, None], torch.arange(64)[None, :]
    want["local"] = (m * ((i - j).abs() < 16)).sum(-1).mean(-1)  # an encoder's window: |i - j| < 16
    roles = {"previous_token": ("previous-token", 0.4), "duplicate_token": ("duplicate-token", 0.3),
             "induction": ("induction", 0.3), "sink": ("sink", 0.5), "local": ("local", 0.7)}
    for kind, (role, thr) in roles.items():
        s = want[kind]
        assert s.shape == (6, 12) and float((s - thr).abs().min()) > 1e-3, kind  # no head on the fence
        heads = sorted(((l, h) for l in range(6) for h in range(12) if s[l, h] >= thr), key=lambda x: -float(s[x]))
        shown = ", ".join(f"{l}.{h}" for l, h in heads[:12]) + (f" (+{len(heads) - 12})" if len(heads) > 12 else "")
        row = (f"<tr><td>{H.escape(role)}</td><td>&ge; {thr}</td><td>{len(heads)} ({100 * len(heads) / 72:.1f}%)"
               f"</td><td>{H.escape(shown or '-')}</td></tr>")
        assert row in page, (kind, row)
    # not vacuous: the definitions tell the kinds apart on this model
    assert (want["previous_token"] >= 0.4).any() and (want["duplicate_token"] >= 0.3).any()
    assert not (want["induction"] >= 0.3).any() and (want["sink"] >= 0.5).sum() > 2


def test_resume_takes_only_its_own_runs_phases(tmp_path, saved_decoder, capsys):
    # --resume reads the phases an interrupted run kept in --out/atlas.json (the runner's units): phases of other
    # options, or of the same options on other inputs (the --texts file changed), are refused; a file of kept
    # phases given to atlas(resume=...) for other settings is replaced, and the atlas says so
    import headlab
    from headlab.interpret.instruments import get
    from headlab.interpret.study.base import Context
    from headlab.interpret.study.runner import check_options
    from headlab.results import Result

    out = tmp_path / "out"
    out.mkdir()
    texts = tmp_path / "ids.txt"
    texts.write_text("\n".join(" ".join(str((i * 7 + j) % 39 + 1) for j in range(40)) for i in range(4)) + "\n")
    args = ["atlas", "--model", saved_decoder, "--texts", texts, "--out", out, "--half", "6", "--max-tokens", "24",
            "--n-texts", "3", "--needles", "2", "--haystack", "30", "--kinds", "induction,sink", "--top-k", "1"]
    kept = {"interrupted": {"kept": 1, "of": 6}, "units": {"repeated": {"key": "another run's", "seconds": 0.1}}}
    Result("head_atlas", settings={"seed": 1}, figures=kept).save(out / "atlas.json")
    code, _, se = run_cli([*args, "--resume"], capsys)
    assert code == 2 and "was computed with other settings" in se, se
    inst = get("atlas")
    options = {"model": str(saved_decoder), "texts": texts, "out": out, "half": 6, "max_tokens": 24, "n_texts": 3,
               "needles": 2, "haystack": 30, "kinds": "induction,sink", "top_k": 1}
    Result("head_atlas", settings=Context(inst, check_options(inst, options)).settings, figures=kept).save(
        out / "atlas.json")
    code, _, se = run_cli([*args, "--resume"], capsys)
    assert code == 2 and "keeps phases (repeated) computed from other inputs" in " ".join(se.split()), se
    assert json.loads((out / "atlas.json").read_text())["units"] == kept["units"]  # refused: nothing replaced

    partial = tmp_path / "atlas.partial.json"
    partial.write_text(json.dumps({"units": kept["units"]}))
    ids = [[(i * 7 + j) % 39 + 1 for j in range(40)] for i in range(4)]
    a = headlab.atlas(headlab.load(saved_decoder), kinds=["induction"], texts=ids, half=6, n_repeated=2, k=1,
                      checks=False, evidence=False, resume=partial)
    assert "held another run's units" in a.notes[-1] and not partial.exists()


def test_the_atlas_takes_a_model_name_as_its_docstring_says():
    import headlab

    a = headlab.atlas("minilm", kinds=["previous_token"], checks=False, evidence=False, half=6, n_repeated=2)
    assert tuple(a.scores["previous_token"].shape) == (6, 12)


def test_what_the_loaded_model_tells_is_checked_before_the_work(tmp_path, saved_decoder, capsys, monkeypatch):
    """A 128-position decoder without a tokenizer: sizes past its positions (the needle trial's own tokens
    measured), too few needles or pieces, ids outside its vocabulary: exit 2, one line, the CLI's names,
    and the atlas never starts (no unit of it runs)."""
    from headlab.interpret.atlas.run import AtlasRun

    class Reached(Exception):
        pass

    def reached(*a, **k):
        raise Reached

    real = AtlasRun.unit
    monkeypatch.setattr(AtlasRun, "unit", reached)
    ids = tmp_path / "ids.txt"
    g = torch.Generator().manual_seed(0)
    ids.write_text("\n".join(" ".join(str(int(x)) for x in torch.randint(1, 40, (40,), generator=g)) for _ in range(4)))
    short = tmp_path / "short.txt"
    short.write_text("1 2 3 4 5 6 7 8 9 10\n")
    big = tmp_path / "big.txt"
    big.write_text("1 2 3 999 5 6 7 8 9 10 11 12\n" * 4)
    base = ["atlas", "--model", saved_decoder, "--out", tmp_path / "o", "--half", "6", "--max-tokens", "24"]
    for more, match in (
            ([], r"has no tokenizer: give --texts FILE"),
            (["--texts", ids, "--half", "65"], r"--half 65: .*past the 128 positions.*give --half 6[34] or less"),
            (["--texts", ids, "--max-tokens", "129"], r"--max-tokens 129 is past the 128 positions"),
            (["--texts", ids, "--haystack", "113"], r"--haystack 113: a needle trial adds 16 tokens .*--haystack 112"),
            (["--texts", ids, "--haystack", "30", "--needles", "1"], r"--needles 1: the retrieval check needs at least 2"),
            (["--texts", short, "--haystack", "30"], r"need at least 2 pieces.*--texts gives 1 .*--max-tokens 24"),
            (["--texts", big, "--haystack", "30", "--max-tokens", "10"], r"--texts example 1: token id 999 is outside "
                                                                          r"the vocabulary .*\(0\.\.39\)"),
            (["--texts", ids, "--haystack", "30", "--top-k", "8"], r"--top-k 8: .* has 8 heads; gate at most 7")):
        code, so, se = run_cli([*base, *more], capsys)
        assert code == 2 and len(se.strip().splitlines()) == 1 and re.search(match, se), (more, se)
    with pytest.raises(Reached):  # no special tokens: 2 x 64 fills the 128 positions exactly, and is let through
        run_cli([*base, "--texts", ids, "--half", "64", "--haystack", "30", "--kinds", "induction"], capsys)
    monkeypatch.setattr(AtlasRun, "unit", real)
    code, so, se = run_cli([*base, "--texts", ids, "--haystack", "112", "--needles", "2", "--draws", "1", "--top-k", "2",
                            "--kinds", "retrieval", "--json"], capsys)  # the needle edge runs
    assert code == 0, se
