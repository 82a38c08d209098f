"""``headlab circuit`` is a row of the ``circuit`` instrument: its options are the command's and ``--help`` lists
them; every bad option is refused in one line, exit 2, before any model loads; a post-norm model (BERT, as MiniLM)
is refused in one line after the load and before any pair is built; a run on a tiny decoder writes what the library
computes (the edge scores, the circuit, the faithfulness curve, the page); Ctrl-C keeps the finished units, and a
unit whose library caught Ctrl-C and returned early is not one of them; ``--scores`` reuses an earlier run's
scores."""

from __future__ import annotations

import json

import pytest
import torch

import headlab
import headlab.cli.main  # noqa: F401  (every command, so every instrument, registered)
from conftest import command_params, run_cli, save_word_level
from headlab.errors import HeadlabError
from headlab.interpret.circuits.circuit import Circuit
from headlab.interpret.circuits.faithfulness_result import Faithfulness
from headlab.interpret.circuits.result import EdgeScores
from headlab.interpret.instruments import get, runner
from headlab.interpret.instruments.circuit import FILES
from headlab.models.transformer import Transformer, TransformerConfig

# (python name, flags, default)
OPTIONS = [("task", {"--task"}, "ioi"), ("pairs", {"--pairs"}, 16), ("model", {"--model", "-m"}, "smollm2"),
           ("method", {"--method"}, "eap-ig"), ("steps", {"--steps"}, 5), ("scores", {"--scores"}, None),
           ("discover", {"--discover"}, "top-n"), ("edges", {"--edges"}, None), ("threshold", {"--threshold"}, None),
           ("criterion", {"--criterion"}, None), ("rank", {"--rank"}, "signed"), ("ablation", {"--ablation"}, "patch"),
           ("faithfulness", {"--faithfulness"}, True), ("random", {"--random"}, 2), ("seed", {"--seed"}, 0),
           ("atlas", {"--atlas"}, None), ("top", {"--top"}, 10), ("out", {"--out", "-o"}, None),
           ("force", {"--force"}, False), ("as_json", {"--json"}, False)]
RUN = ["--task", "induction", "--pairs", "4", "--steps", "2", "--edges", "20%", "--random", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("circuit") / "tiny"
    Transformer(TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True)) \
        .eval().save(path)
    return path


def test_the_command_is_the_instruments_row(capsys):
    inst = get("circuit")
    assert type(inst).__name__ == "CircuitStudy" and inst.result_kind == "circuit_study"
    params = command_params("circuit")
    # no --tensor-parallel: the graph splits pairs, not heads; --resume: the runner keeps the finished units
    assert set(params) == {o.name for o in inst.options} | {"resume"}
    assert [o.name for o in inst.options] == [name for name, _, _ in OPTIONS]
    for name, flags, default in OPTIONS:
        assert set(params[name].opts) == flags and params[name].default == default, name
    assert params["faithfulness"].secondary_opts == ["--no-faithfulness"]
    code, out, _ = run_cli(["circuit", "--help"], capsys)
    assert code == 0
    for _, flags, _ in OPTIONS:
        assert all(f in out for f in flags), flags
    assert "--no-faithfulness" in out and "ioi" in out and "greater-than" in out and "acdc" in out


BAD = [
    (["--task", "copying"], "unknown --task 'copying'; choose one of ioi, greater-than, induction, retrieval"),
    (["--method", "fast"], "unknown --method 'fast'; choose one of eap, eap-ig, exact"),
    (["--discover", "best"], "unknown --discover 'best'; choose one of top-n, greedy, acdc"),
    (["--ablation", "noise"], "unknown --ablation 'noise'; choose one of patch, mean, resample, zero"),
    (["--criterion", "l2"], "unknown --criterion 'l2'; choose one of kl, metric"),
    (["--pairs", "0"], "--pairs must be at least 1, got 0"),
    (["--pairs", "1000000000"], "--pairs must be at most 10,000"),
    (["--steps", "0"], "--steps must be from 1 to 1000"),
    (["--random", "-1"], "--random must be at least 0, got -1"),
    (["--top", "0"], "--top must be at least 1, got 0"),
    (["--edges", "0"], "--edges '0': give a whole number of edges"),
    (["--edges", "150%"], "--edges '150%': give a whole number of edges"),
    (["--edges", "many"], "--edges 'many': give a whole number of edges"),
    (["--discover", "acdc"], "--discover acdc needs --threshold"),
    (["--discover", "acdc", "--threshold", "0.01", "--edges", "10"], "--edges is top-n's and greedy's"),
    (["--discover", "acdc", "--threshold", "-1"], "--threshold must be a number of 0 or more"),
    (["--threshold", "0.1"], "--threshold is ACDC's"),
    (["--criterion", "kl"], "--criterion is ACDC's"),
    (["--ablation", "resample", "--pairs", "1"], "--ablation resample gives each pair another pair's corrupted run"),
    (["--pairs", "x"], "Invalid value for '--pairs'"),
    (["--atlas", "{missing}"], "--atlas"),
    (["--atlas", "{not_atlas}"], "--atlas"),
    (["--scores", "{not_scores}"], "--scores"),
    (["--discover", "acdc", "--threshold", "0.01", "--scores", "{not_scores}"], "ACDC measures each edge itself"),
    (["--out", "{a_file}"], "--out"),
]


@pytest.mark.parametrize("args,match", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options_are_refused_in_one_line_before_the_load(args, match, tmp_path, no_load, capsys):
    (tmp_path / "not_atlas.json").write_text('{"kind_of_result": "patching"}')
    (tmp_path / "not_scores.json").write_text('{"headlab": {"kind": "patch"}}')
    (tmp_path / "a_file").write_text("x")
    args = [a.format(missing=tmp_path / "missing.json", not_atlas=tmp_path / "not_atlas.json",
                     not_scores=tmp_path / "not_scores.json", a_file=tmp_path / "a_file") for a in args]
    code, out, err = run_cli(["circuit", *args], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error:"), err
    assert match in " ".join(err.split()), err


def test_the_runner_refuses_the_same_before_the_load(no_load):
    with pytest.raises(HeadlabError, match="--discover acdc needs --threshold"):
        runner.run("circuit", {"discover": "acdc"})


def test_a_post_norm_model_is_refused_after_the_load_before_any_pair(tmp_path, capsys, monkeypatch):
    """MiniLM is a BERT: the stream is normalised after attention, so its graph has no edges to score."""
    import transformers

    from importlib import import_module

    tasks = import_module("headlab.interpret.circuits.tasks")

    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32)).eval()
    folder = save_word_level(tmp_path / "bert", bert, ["<pad>", "<unk>", "a", "b", "c", "d", "e", "f"])
    monkeypatch.setattr(tasks, "task", lambda *a, **k: pytest.fail("pairs were built before the refusal"))
    code, _, err = run_cli(["circuit", "--model", folder, "--out", tmp_path / "o"], capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, err
    assert f"--model {folder}: the 'bert' model normalises after attention" in errors[0]
    assert not (tmp_path / "o").exists()


def test_a_run_writes_what_the_library_computes(tiny, tmp_path, capsys):
    from headlab.interpret.circuits import edge_scores
    from headlab.interpret.circuits.discovery import discover
    from headlab.interpret.circuits.evaluation import faithfulness
    from headlab.interpret.circuits.tasks import task

    out = tmp_path / "o"
    code, so, se = run_cli(["circuit", "--model", tiny, *RUN, "--out", out, "--json"], capsys)
    assert code == 0, se
    doc = json.loads(so)
    assert doc["headlab"]["kind"] == "circuit_study" and doc["n_graph_edges"] == 82
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    loaded = headlab.load(tiny)
    p = task("induction", loaded, n=4, seed=0)
    s = edge_scores(loaded, p.clean, p.corrupted, p.metric, method="eap-ig", steps=2)
    want = discover(loaded, p.clean, p.corrupted, p.metric, n_edges=17, scores=s,  # 20% of 82 edges, rounded up
                    absolute=False)  # --rank signed
    got = Circuit.load(out / "circuit.json")
    assert got.edges == want.edges and got.settings["chosen"] == 17
    assert torch.allclose(EdgeScores.load(out / "scores.json").values, s.values, atol=1e-9)
    f = faithfulness(loaded, s, p.clean, p.corrupted, p.metric, random=1, seed=0, templates=p.template,
                     absolute=False)
    saved = Faithfulness.load(out / "faithfulness.json")
    assert saved.sizes == f.sizes and saved.f == pytest.approx(f.f, abs=1e-9) and saved.cpr == pytest.approx(f.cpr)
    assert doc["circuit"]["edges"] == want.edges and doc["faithfulness"]["f"] == pytest.approx(f.f, abs=1e-9)
    page = (out / "circuit.html").read_text(encoding="utf-8")
    assert page.count('<line class="edge"') == len(got.edges) and '<svg class="faithfulness"' in page


def test_ctrl_c_keeps_the_finished_units_and_scores_are_reused(tiny, tmp_path, capsys, monkeypatch):
    from importlib import import_module

    eap = import_module("headlab.interpret.circuits.eap")  # the modules (the package exports functions of these names)
    faith = import_module("headlab.interpret.circuits.evaluation")

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(faith, "faithfulness", stop)
    out = tmp_path / "o"
    code, _, err = run_cli(["circuit", "--model", tiny, *RUN, "--out", out], capsys)
    assert code == 130 and "interrupted: kept 2 of 3 units" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["circuit.html", "circuit.json", "circuit.partial.json",
                                                     "scores.json"]  # the units themselves, for --resume
    kept = Circuit.load(out / "circuit.json")

    from headlab.interpret.atlas import Atlas
    from headlab.results import write_json

    atlas = Atlas(model="tiny", family="transformer", causal=True, n_layers=2, n_heads=4, n_kv_heads=2,
                  kv_group=torch.tensor([[0, 0, 1, 1]] * 2), scores={"induction": torch.full((2, 4), 0.9)},
                  thresholds={"induction": 0.5})  # every head an induction head: each node of the page says so
    write_json(tmp_path / "atlas.json", atlas.to_json())
    monkeypatch.setattr(eap, "edge_scores", lambda *a, **k: pytest.fail("the scores were computed again"))
    code, so, err = run_cli(["circuit", "--model", tiny, *RUN, "--scores", out / "scores.json", "--no-faithfulness",
                             "--atlas", tmp_path / "atlas.json", "--out", tmp_path / "again"], capsys)
    assert code == 0, err
    assert Circuit.load(tmp_path / "again" / "circuit.json").edges == kept.edges
    page = (tmp_path / "again" / "circuit.html").read_text(encoding="utf-8")
    svg = page[page.index('<svg class="circuit"'):page.index("</svg>")]
    heads = {n for n in kept.nodes if n.startswith("a")}  # the heads on a path: every one labelled
    assert heads and all(f'data-node="{h}" data-kind="head"><title>{h}: induction</title>' in svg for h in heads)
    text = " ".join(so.split())  # the terminal's lines
    assert f"(read from {out / 'scores.json'})" in text and f"circuit (top-n): {kept.n_edges} edges" in text
    assert f"wrote: {tmp_path / 'again' / 'scores.json'}" in text and "CPR" not in text


def test_an_exact_scoring_cut_short_is_not_a_finished_unit(tiny, tmp_path, capsys, monkeypatch):
    """edge_patch catches Ctrl-C and returns NaN for the edges it did not reach: the row stops with nothing kept."""
    from importlib import import_module

    patching = import_module("headlab.interpret.circuits.patching")

    real, calls = patching._edge_chunk, []

    def second_chunk_interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(patching, "_edge_chunk", second_chunk_interrupted)
    code, _, err = run_cli(["circuit", "--model", tiny, *RUN, "--method", "exact", "--out", tmp_path / "o"], capsys)
    assert code == 130 and "interrupted: kept 0 of 3 units" in err, err
    assert len(calls) == 2


def test_acdc_and_the_sizes_against_the_graph(tiny, tmp_path, capsys):
    from headlab.interpret.circuits.discovery import discover
    from headlab.interpret.circuits.tasks import task

    code, so, err = run_cli(["circuit", "--model", tiny, "--task", "induction", "--pairs", "2", "--method", "eap",
                             "--discover", "acdc", "--threshold", "0.001", "--no-faithfulness", "--json"], capsys)
    assert code == 0, err
    loaded = headlab.load(tiny)
    p = task("induction", loaded, n=2, seed=0)
    want = discover(loaded, p.clean, p.corrupted, p.metric, method="acdc", threshold=0.001)
    assert json.loads(so)["circuit"]["edges"] == want.edges
    code, _, err = run_cli(["circuit", "--model", tiny, *RUN[:6], "--edges", "500"], capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "has 82 edges" in errors[0], err


def test_exact_scoring_of_a_large_graph_is_refused_with_its_cost(tiny, tmp_path, capsys, monkeypatch):
    """--method exact on a graph above the command's limit: one line with the number of forwards, before any pair."""
    from importlib import import_module

    row = import_module("headlab.interpret.instruments.circuit")
    monkeypatch.setattr(row, "EXACT_MAX_EDGES", 50)  # the tiny graph has 82 edges
    code, _, err = run_cli(["circuit", "--model", tiny, *RUN, "--method", "exact", "--out", tmp_path / "o"], capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, err
    assert "82 edges" in errors[0] and "stacked forwards" in errors[0] and "--method eap-ig" in errors[0]
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
