"""The instrument contract and the study runner: adding an instrument is one class and its registration; the
runner checks before it loads, keeps every finished unit on Ctrl-C, resumes only the rest, records once for
instruments run together; the one reader says in one line what is wrong with a file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from headlab.errors import ConfigError, HeadlabError, InputError, TreebankError
from headlab.interpret.instruments import (Instrument, InstrumentResult, Option, Output, Part, Unit, at_least,
                                           get, register, registered, unregister)
from headlab.interpret.instruments import runner
from headlab.models.transformer import Transformer, TransformerConfig
from headlab.reading import read

V = 40
WORDS = {w: i + 1 for i, w in enumerate("the cat sat on a mat dog ran far away".split())}


def _model():
    torch.manual_seed(0)
    return Transformer(TransformerConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, causal=True)).eval()


def _ids(text: str) -> torch.Tensor:
    return torch.tensor([[WORDS[w] for w in text.split()]])


class Lengths(Instrument):
    """A test instrument: each line of --texts is a unit whose value is its word count times --scale."""

    name = "lengths_test"
    summary = "Count the words of each text, times --scale."
    options = (
        Option("texts", "--texts", Path, ..., "a file of texts, one per line", reads="texts"),
        Option("scale", "--scale", int, 1, "multiply every count", check=at_least(1)),
        Option("model", "--model", str, "tiny", "the model"),
        Option("out", "--out", Path, None, "the result file", short="-o", setting=False),
    )
    output = Output("out", folder=False)
    resumable = True
    loads: list = []  # one entry per load
    calls: list = []  # the key of every run_unit call
    stop_at: int | None = None  # raise KeyboardInterrupt in this unit

    def load(self, ctx):
        self.loads.append(ctx.options["model"])
        return _model()

    def units(self, ctx):
        return [Unit(f"{i}", t) for i, t in enumerate(ctx.data["texts"])]

    def run_unit(self, ctx, unit, recording=None):
        if self.stop_at is not None and int(unit.key) == self.stop_at:
            raise KeyboardInterrupt
        self.calls.append(unit.key)
        return len(unit.payload.split()) * ctx.options["scale"]

    def finish(self, ctx, values):
        return InstrumentResult(self.name, model="tiny", settings=ctx.settings,
                                figures={"counts": [values[k] for k in sorted(values, key=int)]})

    def render(self, ctx, outcome, console, err):
        console.print("counts: " + " ".join(map(str, outcome.result.figures["counts"])))


@pytest.fixture
def lengths():
    register(Lengths)
    Lengths.loads.clear(), Lengths.calls.clear()
    Lengths.stop_at = None
    yield get("lengths_test")
    unregister("lengths_test")


@pytest.fixture
def texts(tmp_path):
    lines = ["the cat sat", "a dog ran far away", "on a mat", "the dog", "cat"]
    p = tmp_path / "texts.txt"
    p.write_text("\n".join(lines) + "\n")
    return p, [len(t.split()) for t in lines]


def test_an_instrument_is_one_class_and_its_registration(lengths, texts, tmp_path):
    path, counts = texts
    out = runner.run("lengths_test", {"texts": path, "scale": 3, "out": tmp_path / "r.json"})
    assert out.result.figures["counts"] == [3 * c for c in counts] and Lengths.loads == ["tiny"]
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["headlab"]["kind"] == "lengths_test" and on_disk["headlab"]["settings"] == {
        "texts": str(path), "scale": 3, "model": "tiny"}
    assert on_disk["counts"] == [3 * c for c in counts] and "interrupted" not in on_disk
    # the same instrument as a CLI row, through typer
    from headlab.cli.rows import row

    app = typer.Typer()
    app.callback()(lambda: None)
    row(app, "lengths", "lengths_test")
    cli = CliRunner()
    res = cli.invoke(app, ["lengths", "--help"])
    assert res.exit_code == 0 and "--scale" in res.output and "--resume" in res.output
    res = cli.invoke(app, ["lengths", "--texts", str(path), "--scale", "2", "-o", str(tmp_path / "cli.json")])
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines()[-1] == "counts: " + " ".join(str(2 * c) for c in counts)
    assert "loading model tiny" in res.output and "units: 5/5 (100%)" in res.output  # the protocol, plain when piped
    assert json.loads((tmp_path / "cli.json").read_text())["counts"] == [2 * c for c in counts]
    Lengths.stop_at, Lengths.calls[:] = 2, []  # Ctrl-C in the third unit: exit 130, two units kept
    res = cli.invoke(app, ["lengths", "--texts", str(path), "-o", str(tmp_path / "int.json")])
    assert res.exit_code == 130 and f"interrupted: kept 2 of 5 units in {tmp_path / 'int.json'}" in res.output
    Lengths.stop_at, Lengths.calls[:] = None, []
    res = cli.invoke(app, ["lengths", "--texts", str(path), "-o", str(tmp_path / "int.json"), "--resume"])
    assert res.exit_code == 0 and Lengths.calls == ["2", "3", "4"]
    assert json.loads((tmp_path / "int.json").read_text())["counts"] == counts
    res = cli.invoke(app, ["lengths", "--texts", str(path), "--scale", "0"])
    assert isinstance(res.exception, ConfigError) and "--scale must be at least 1, got 0" in str(res.exception)
    unregister("lengths_test")
    assert "lengths_test" not in [i.name for i in registered()]
    with pytest.raises(ConfigError, match="no instrument named 'lengths_test'; registered: .*flow"):
        get("lengths_test")
    register(Lengths)  # the fixture unregisters it again


def test_registry_refuses_a_nameless_or_second_instrument(lengths):
    with pytest.raises(TypeError, match="already registered"):
        register(type("Again", (Instrument,), {"name": "lengths_test"}))
    with pytest.raises(TypeError, match="has no name"):
        register(type("Nameless", (Instrument,), {}))
    from headlab.interpret.report.sections import base

    assert issubclass(base.Section, Part) and issubclass(Instrument, Part)
    assert base._SECTIONS is base._REGISTRY.items and [s.name for s in base.registered()][:1] == ["heads"]


@pytest.mark.parametrize("options, match", [
    ({"scale": 0}, r"--scale must be at least 1, got 0"),
    ({"scale": 2, "bogus": 1}, r"lengths_test takes no option bogus"),
    ({"out": "{file}/sub.json"}, r"--out '.*/sub.json': '.*file' is a file, not a folder"),
    ({"out": "{tmp}"}, r"--out '.*' is a folder; give a file name"),
    ({"out": "{tmp}/none/r.json"}, r"the folder '.*none' does not exist"),
    ({"texts": "{tmp}/none.txt"}, r"--texts '.*none.txt' does not exist"),
])
def test_the_runner_refuses_before_loading(lengths, texts, tmp_path, options, match):
    (tmp_path / "file").write_text("x")
    opts = {"texts": texts[0], **{k: v.format(tmp=tmp_path, file=tmp_path / "file") if isinstance(v, str) else v
                                  for k, v in options.items()}}
    with pytest.raises(HeadlabError, match=match):
        runner.run(lengths, opts)
    assert Lengths.loads == [] and Lengths.calls == []


def test_the_default_loader_is_not_called_for_a_bad_flow_option(monkeypatch):
    import headlab.models

    monkeypatch.setattr(headlab.models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match="--mode acts only with --method norms"):
        runner.run("flow", {"text": "the cat", "mode": "residual"})
    with pytest.raises(InputError, match="TEXT is empty"):
        runner.run("flow", {"text": "  "})


def test_ctrl_c_keeps_the_finished_units_and_resume_does_only_the_rest(lengths, texts, tmp_path):
    path, counts = texts
    target = tmp_path / "r.json"
    said = []
    Lengths.stop_at = 3
    out = runner.run(lengths, {"texts": path, "out": target}, say=said.append)
    assert out.interrupted and out.kept == 3 and out.total == 5 and out.result is None
    assert said == [f"interrupted: kept 3 of 5 units in {target}; run again with --resume to finish the rest"]
    partial = json.loads(target.read_text())
    assert partial["interrupted"] == {"kept": 3, "of": 5}
    assert partial["units"] == {str(i): counts[i] for i in range(3)} and Lengths.calls == ["0", "1", "2"]
    with pytest.raises(InputError, match=r"--out '.*r.json' exists; .*--force"):  # not resuming: kept, not replaced
        runner.run(lengths, {"texts": path, "out": target})
    with pytest.raises(InputError, match=r"other settings \(scale\)"):
        runner.run(lengths, {"texts": path, "out": target, "scale": 2}, resume=True)
    with pytest.raises(InputError, match=r"--resume keeps the units .* writes none; give --out"):
        runner.run(lengths, {"texts": path}, resume=True)
    Lengths.stop_at, Lengths.calls[:] = None, []
    done = runner.run(lengths, {"texts": path, "out": target}, resume=True)
    assert Lengths.calls == ["3", "4"]  # only the rest
    assert done.result.figures["counts"] == counts
    final = json.loads(target.read_text())
    assert "interrupted" not in final and final["counts"] == counts
    Lengths.calls[:] = []
    again = runner.run(lengths, {"texts": path, "out": target}, resume=True)  # nothing left to do
    assert Lengths.calls == [] and again.result.figures["counts"] == counts


def test_an_interrupt_in_the_first_unit_writes_nothing(lengths, texts, tmp_path):
    said = []
    Lengths.stop_at = 0
    out = runner.run(lengths, {"texts": texts[0], "out": tmp_path / "r.json"}, say=said.append)
    assert out.interrupted and out.kept == 0 and not (tmp_path / "r.json").exists()
    assert said == ["interrupted: kept 0 of 5 units nothing was written (no unit had finished)"]


class _Reads(Instrument):
    """Reads one site of the shared recording: its value is that site's tensor."""

    site = ""
    options = (Option("texts", "--texts", Path, ..., "texts", reads="texts"),
               Option("model", "--model", str, "tiny", "the model"))

    def load(self, ctx):
        return _model()

    def sites(self, ctx):
        return [self.site]

    def units(self, ctx):
        return [Unit(str(i), t) for i, t in enumerate(ctx.data["texts"])]

    def unit_inputs(self, ctx, unit):
        return _ids(unit.payload)

    def run_unit(self, ctx, unit, recording=None):
        return recording[self.site]

    def finish(self, ctx, values):
        return InstrumentResult(self.name, figures={"values": values})


def test_instruments_run_together_share_one_recording_per_unit(texts, monkeypatch):
    from headlab.interpret import capture as capture_room

    class Pattern(_Reads):
        name, site = "pattern_test", "blocks.1.attn.pattern"

    class Inputs(_Reads):
        name, site = "inputs_test", "blocks.0.attn.input"

    calls = []
    real = capture_room.capture
    monkeypatch.setattr(capture_room, "capture", lambda *a, **k: calls.append(sorted(k["sites"])) or real(*a, **k))
    path, counts = texts
    a, b = runner.run_together([(Pattern(), {"texts": path}), (Inputs(), {"texts": path})])
    assert calls == [["blocks.0.attn.input", "blocks.1.attn.pattern"]] * len(counts)  # one recording per unit
    model = _model()
    for i, line in enumerate(path.read_text().split("\n")[:len(counts)]):
        alone = real(model, _ids(line), sites=["blocks.1.attn.pattern", "blocks.0.attn.input"])
        assert torch.allclose(a.result.figures["values"][str(i)], alone["blocks.1.attn.pattern"])
        assert torch.allclose(b.result.figures["values"][str(i)], alone["blocks.0.attn.input"])
        assert a.result.figures["values"][str(i)].shape == (1, 4, counts[i], counts[i])


# ---- the one reader ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, content, match, error", [
    ("texts", b"caf\xe9\n", r"--in '.*' is not UTF-8 text: byte 0xe9 at byte 3 of 5; convert it first", InputError),
    ("tsv", b"sentence\tlabel\ncaf\xe9\t1\n", r"is not UTF-8 text: byte 0xe9 at byte 18", InputError),
    ("conllu", b"# text = caf\xe9\n", r"is not CoNLL-U: not UTF-8 text: byte 0xe9", TreebankError),
    ("json", b'{"a": "\xff"}', r"is not JSON: not UTF-8 text: byte 0xff at byte 7", InputError),
    ("texts", b"  \n\n", r"--in '.*' is empty; give a plain-text file", InputError),
    ("tsv", b"words\tlabel\nthe cat\t1\n", r"no 'sentence' or 'text' column; the header has \['words', 'label'\]",
     InputError),
    ("tsv", b"label\tsentence\n1\n", r"line 2: 1 field\(s\) for a header of 2; is a tab missing\?", InputError),
    ("tsv", b"sentence\tlabel\nthe cat\tpos\n", r"line 2: label 'pos' is not an integer class", InputError),
    ("tsv", b"sentence\tlabel\n", r"has a header but no rows", InputError),
    ("conllu", b"1\tThe\n", r":1: not CoNLL-U: expected 10 tab-separated columns .* got 2", TreebankError),
    ("conllu", b"x\tThe\tthe\tDET\t_\t_\t2\tdet\t_\t_\n", r":1: not CoNLL-U: ID 'x' is not a word index",
     TreebankError),
    ("conllu", b"# only a comment\n", r"holds no sentence", TreebankError),
    ("json", b'{"a": 1,}', r"is not JSON: Expecting property name .* at line 1 column 9", InputError),
])
def test_the_reader_says_in_one_line_what_is_wrong(tmp_path, kind, content, match, error):
    p = tmp_path / f"in.{kind}"
    p.write_bytes(content)
    with pytest.raises(error, match=match) as e:
        read(kind, p, "--in")
    assert "\n" not in str(e.value) and str(e.value).startswith("--in ")


def test_the_reader_refuses_a_missing_file_a_folder_and_a_device(tmp_path):
    for kind in ("texts", "tsv", "conllu", "json"):
        with pytest.raises(InputError, match=r"--in '.*none' does not exist \(no such .* file\); give "):
            read(kind, tmp_path / "none", "--in")
        with pytest.raises(InputError, match=r"--in '.*' is a folder; give "):
            read(kind, tmp_path, "--in")
        with pytest.raises(InputError, match=r"--in '/dev/null' is not a regular file"):
            read(kind, "/dev/null", "--in")
    with pytest.raises(InputError, match=r"TEXT: the text is not valid UTF-8: byte 0xe9 at byte 3 of 4"):
        read("text", "caf\udce9", "TEXT")


def test_the_reader_reads_each_kind(tmp_path):
    (tmp_path / "a.tsv").write_text("label\tsentence\n1\tthe cat\n\n0\ta dog\n")
    assert [(r.line, r.text, r.label) for r in read("tsv", tmp_path / "a.tsv", "--d")] == [
        (2, "the cat", 1), (4, "a dog", 0)]
    (tmp_path / "b.tsv").write_text("text\nthe cat\n")
    assert [(r.text, r.label) for r in read("tsv", tmp_path / "b.tsv", "--d")] == [("the cat", None)]
    (tmp_path / "t.conllu").write_text("# text = The cat.\n1\tThe\tthe\tDET\t_\t_\t2\tdet\t_\t_\n"
                                       "2\tcat\tcat\tNOUN\t_\t_\t0\troot\t_\t_\n\n# text = Hi\n1\tHi\thi\tINTJ\t_\t_\t0\t"
                                       "root\t_\t_\n")
    tb = read("conllu", tmp_path / "t.conllu", "--t")
    assert len(tb.sentences) == 2 and tb.texts() == ["The cat.", "Hi"] and tb.sentences[1][1][0] == 6
    assert len(read("conllu", tmp_path / "t.conllu", "--t", limit=1).sentences) == 1
    (tmp_path / "x.json").write_text('{"a": [1, 2]}')
    assert read("json", tmp_path / "x.json", "--j") == {"a": [1, 2]}
    (tmp_path / "x.txt").write_text("one\n\n two \n")
    assert read("texts", tmp_path / "x.txt", "--t") == ["one", "two"]


# ---- torchrun: units split across ranks, gathered on rank 0 ---------------------------------------

RANK_SCRIPT = '''
import json, os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import test_instruments as t
from headlab.interpret.instruments import register, runner
register(t.Lengths)
out = runner.run("lengths_test", {{"texts": Path({texts!r}), "out": Path({out!r})}})
Path({log!r} + os.environ["RANK"]).write_text(json.dumps({{"calls": t.Lengths.calls, "main": out.main,
    "counts": out.result.figures["counts"] if out.result else None}}))
'''


@pytest.mark.distributed
def test_under_torchrun_the_units_are_split_across_ranks_and_gathered_on_rank_0(texts, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path, counts = texts
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(tests=str(Path(__file__).parent), texts=str(path),
                                         out=str(tmp_path / "r.json"), log=str(tmp_path / "rank")))
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "HEADLAB_PROGRESS": "plain"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    try:
        logs = [p.communicate(timeout=180)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    got = [json.loads((tmp_path / f"rank{r}").read_text()) if (tmp_path / f"rank{r}").exists() else logs[r]
           for r in range(2)]
    assert all(isinstance(g, dict) for g in got), got
    assert got[0]["calls"] == ["0", "2", "4"] and got[1]["calls"] == ["1", "3"]  # every W-th unit, from the rank
    assert got[0]["main"] and not got[1]["main"] and got[0]["counts"] == counts and got[1]["counts"] is None
    assert json.loads((tmp_path / "r.json").read_text())["counts"] == counts  # rank 0 wrote every unit


def test_the_heads_examples_read_as_their_suffix_says(tmp_path):
    """--data by suffix, against the values written into each file (the heads room and the instruments share
    one reader now, so the expected values are the files' own, not a second reader's)."""
    from headlab.interpret.heads.examples import read_texts
    from headlab.interpret.instruments.heads import read_examples
    from headlab.interpret.probing.treebank import read_treebank

    files = {"a.tsv": "sentence\tlabel\nthe cat sat\t1\na dog\t0\nfar away\t1\n", "b.tsv": "id\ttext\n7\tthe cat\n",
             "c.txt": "1 2 3\n\n4 5\n", "d.conllu": "# text = The cat.\n1\tThe\tthe\tDET\t_\t_\t2\tdet\t_\t_\n"
             "2\tcat\tcat\tNOUN\t_\t_\t0\troot\t_\t_\n3\t.\t.\tPUNCT\t_\t_\t2\tpunct\t_\t_\n"}
    expected = {"a.tsv": (["the cat sat", "a dog", "far away"], [1, 0, 1]), "b.tsv": (["the cat"], None),
                "c.txt": (["1 2 3", "4 5"], None), "d.conllu": (["The cat."], None)}
    for name, body in files.items():
        (tmp_path / name).write_text(body)
        texts, labels = expected[name]
        for limit in (None, 2):
            want = (texts[:limit], None if labels is None else labels[:limit])
            assert read_examples(tmp_path / name, limit=limit) == read_texts(tmp_path / name, limit=limit) == want
    (tmp_path / "e.tsv").write_text("sentence\tlabel\nthe cat\t1\n \t0\n")
    with pytest.raises(InputError, match=r"--data '.*e.tsv' line 3: the sentence is empty"):
        read_texts(tmp_path / "e.tsv")
    conllu = read("conllu", tmp_path / "d.conllu", "--treebank")
    assert len(conllu.sentences) == len(read_treebank(tmp_path / "d.conllu").sentences) == 1


def test_the_heads_studies_report_through_the_protocol():
    """importance_study and ablate run their instruments through the runner (runner.call), so progress(stage, done,
    total) sees the runner's units: the instrument's stage counts to its total, and the total is the work
    (importance: one unit per batch; ablation: the single batches, then the pair batches)."""
    from headlab.interpret.heads.ablation import ablate
    from headlab.interpret.heads.importance import importance_study
    from headlab.interpret.instruments.heads import HeadAblation, HeadImportance

    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=30, d_model=16, n_layers=2, n_heads=2, causal=True)).eval()
    texts = [torch.randint(0, 30, (8,)) for _ in range(5)]
    batches = 3  # 5 examples, 2 per batch
    seen: list[tuple[str, int, int]] = []
    importance_study(m, texts, loss="lm", batch_size=2, progress=lambda *a: seen.append(a))
    assert seen == [(HeadImportance.stage, d, batches) for d in range(1, batches + 1)]
    seen.clear()
    ablate(m, texts, loss="lm", k=2, keep_one=False, batch_size=2, n_boot=20, cka=False, max_rows=2,
           progress=lambda *a: seen.append(a))
    batches = 2  # ablation's batches hold at least 2 examples (min_size=2): the lone fifth joins the last
    assert seen == [(HeadAblation.stage, d, 2 * batches) for d in range(1, 2 * batches + 1)]  # singles, then pairs
    assert HeadImportance.display and HeadAblation.display  # the runner's display, no bars of their own
