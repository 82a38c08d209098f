"""``headlab patch``: --help, errors before loading (exit 2, one line), and a run on a tiny saved GPT-2."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import headlab
from conftest import run_cli, save_word_level
from headlab.interpret.patching import logit_diff, patch
from headlab.interpret.patching.prompts import prompt_pair

WORDS = ["<pad>", "<unk>", "When", "Mary", "and", "John", "Anne", "Paul", "went", "to", "the", "store", ",", "gave",
         "a", "drink", "Bob Smith"]
CLEAN = "When Mary and John went to the store , John gave a drink to"
CORRUPT = "When Anne and Paul went to the store , Paul gave a drink to"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(WORDS), n_embd=32, n_layer=2, n_head=4, n_positions=32, attn_implementation="eager")).eval()
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    return save_word_level(folder, model, WORDS)


def _args(folder, *more):
    return ["patch", "--model", str(folder), "--clean", CLEAN, "--corrupted", CORRUPT, "--answer", " Mary",
            "--wrong", " John", *more]


def test_help(capsys):
    code, out, _ = run_cli(["patch", "--help"], capsys)
    assert code == 0 and "--clean" in out and "--answer" in out and "--sites" in out


def test_errors_exit_2_before_loading(tmp_path, tiny_folder, capsys):
    missing = str(tmp_path / "no-such-model")  # options are refused before the model is looked for
    for more, needle in ((["--sites", "head_out"], "kinds"), (["--method", "fast"], "--method"),
                         (["--positions", "x"], "--positions"), (["--out", str(tmp_path / "r.txt")], ".json"),
                         (["--sites", "resid_pre", "--method", "both"], "gradients")):
        code, _, err = run_cli(_args(missing, *more), capsys)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(_args(tiny_folder, "--wrong", " Bob Smith"), capsys)
    assert code == 2 and "tokens" in err  # "Bob Smith" is two words: two tokens
    code, _, err = run_cli(["patch", "--model", str(tiny_folder), "--clean", CLEAN, "--corrupted", "When Anne",
                            "--answer", " Mary", "--wrong", " John"], capsys)
    assert code == 2 and "as many tokens" in err


def test_json_equals_library_and_files(tmp_path, tiny_folder, capsys):
    code, out, err = run_cli(_args(tiny_folder, "--json", "--method", "both", "--out", str(tmp_path / "r.json")),
                             capsys)
    assert code == 0, err
    doc = json.loads(out)
    loaded = headlab.load(str(tiny_folder))
    a, b, metric = prompt_pair(loaded, CLEAN, CORRUPT, " Mary", " John")
    ids = loaded.tokenizer([" Mary", " John"], add_special_tokens=False)["input_ids"]
    want = patch(loaded, a["input_ids"], b["input_ids"], logit_diff(ids[0], ids[1]))
    got = torch.tensor([[float("nan") if v is None else v for v in row] for row in doc["exact"]["raw"]["z"]])
    assert torch.allclose(got, want.raw["z"], atol=1e-4)
    assert doc["exact"]["clean"] == pytest.approx(want.clean, abs=1e-5)
    # the agreement figure is Spearman's rho of the two grids in the document (scipy, here), and on this
    # default-initialised model (small weights: near linear) attribution ranks the heads as exact patching does
    from scipy.stats import spearmanr

    ex_e, at_e = (torch.tensor(doc[m]["effects"]["z"], dtype=torch.float64).flatten() for m in ("exact", "attribution"))
    rho = doc["agreement"]["z"]["spearman"]
    assert len(ex_e) == 8 and rho == pytest.approx(float(spearmanr(ex_e, at_e).statistic), abs=1e-6)
    assert rho >= 0.9 and float(spearmanr(ex_e, -at_e).statistic) < 0.9  # a sign-flipped attribution would miss it
    assert json.loads((tmp_path / "r.json").read_text())["attribution"]["method"] == "attribution"
    code, out, err = run_cli(_args(tiny_folder, "--out", str(tmp_path / "r.html"), "--sites", "z,v"), capsys)
    assert code == 0 and "top heads" in out and (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    code, _, err = run_cli(_args(tiny_folder, "--out", str(tmp_path / "r.html")), capsys)
    assert code == 2 and "--force" in err


@pytest.mark.browser
def test_page_renders_in_chromium(tmp_path):
    from conftest import require_browser
    from test_browser import open_page

    browser = require_browser()
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=20, n_embd=16, n_layer=2, n_head=2,
                                                             n_positions=16, attn_implementation="eager")).eval()
    clean, bad = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
    r = patch(m, clean, bad, logit_diff(6, 7), sites=["z", "v"])
    dom, console = open_page(browser, r.page(), tmp_path, "patch.html")
    assert "patching: GPT2LMHeadModel" in dom and dom.count('class="grid"') == 2
    assert dom.count("<td ") + dom.count("<td>") == 2 * 2 * 2  # two grids of 2 layers x 2 heads
    assert not [ln for ln in console if "Error" in ln], console


def test_degenerate_pairs_the_tokenizer_reveals_exit_2_before_the_work(tiny_folder, capsys, monkeypatch):
    """Texts that differ but tokenise alike (the answer and the wrong word, or the two prompts): the effect would
    be 0/0, so they are refused once the tokenizer has read them, before any patched run."""
    import headlab.interpret.patching as patching

    monkeypatch.setattr(patching, "patch", lambda *a, **k: pytest.fail("patching ran"))
    for args, needle in ((_args(tiny_folder, "--wrong", "Mary"), "--answer and --wrong are the same token ('Mary'"),
                         (["patch", "--model", str(tiny_folder), "--clean", CLEAN, "--corrupted", CLEAN + " ",
                           "--answer", " Mary", "--wrong", " John"], "tokenise to the same tokens"),
                         (_args(tiny_folder, "--positions", "3,99"), "--positions 3,99: position 99 is not an index "
                                                                     "into 14 positions")):
        code, _, err = run_cli(args, capsys)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(headlab.errors.InputError, match="same token"):
        prompt_pair(headlab.load(str(tiny_folder)), [CLEAN, CORRUPT], [CORRUPT, CLEAN], [" Mary", " John"], " John")
