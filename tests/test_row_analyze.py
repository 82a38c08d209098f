"""`headlab analyze` is a row: the ``analyze`` instrument's options are the command's, a bad option is refused
before any load, the runner records the text once for the union of the sections' sites (full mode) and the job
computes the same report from it as the library's own recording, streaming mode records itself (with the sink
positions), and Ctrl-C in the one unit says that nothing was kept."""

from __future__ import annotations

import json

import pytest
import torch

import headlab
from headlab.interpret.instruments import get
from headlab.interpret.report.instrument import Analyze
from headlab.interpret.report import analyze_job
from conftest import command_params, run_cli

TEXT = "the cat sat on the mat because it was tired"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random two-layer GPT-2 (4 heads) with MiniLM's tokenizer (no weights of MiniLM read), saved as a folder."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from headlab.models.named_models import KNOWN_MODELS

    tokenizer = AutoTokenizer.from_pretrained(KNOWN_MODELS["minilm"]())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4))
    folder = tmp_path_factory.mktemp("tiny") / "gpt2"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(tiny):
    return headlab.load(tiny)


@pytest.fixture
def reuse(loaded, monkeypatch):
    """The row loads the module's tiny model (once per module) instead of reading the folder again."""
    monkeypatch.setattr(Analyze, "load", lambda self, ctx: loaded)


def test_the_command_is_the_instruments_row():
    inst = get("analyze")
    assert isinstance(inst, Analyze)
    params = command_params("analyze")
    cli = [o for o in inst.options if not o.python]  # headlab.analyze's own (thresholds, annotations) have no flag
    assert set(params) == {o.name for o in cli} | {"tensor_parallel", "tensor_size"}
    for o in cli:
        p = params[o.name]
        assert (o.flag is None) == (p.param_type_name == "argument"), o.name
        assert o.flag is None or (o.flag in p.opts and (o.short is None or o.short in p.opts)), o.name
        assert o.default is ... or p.default == o.default, o.name


BAD = [
    (["--max-full-tokens", "0"], r"max_full_tokens must be at least 1, got 0"),
    (["--backend", "warp"], r"'warp'"),
    (["--heads", "2.0"], r"--heads 2\.0 is out of range: .*head 2\.0 does not exist"),  # the config has 2 layers
    (["--out", "/proc/headlab-x"], r"'/proc/headlab-x' is under /proc"),
    (["--probe", "{tmp}/none.json"], r"--probe .*none.json: no such file"),
    (["--json", "--heads-result", "{tmp}/none.json"], r"--heads .*none.json: no such file"),
]


@pytest.mark.parametrize("args,match", BAD, ids=[a[0] for a, _ in BAD])
def test_a_bad_option_is_refused_before_the_load(args, match, tiny, tmp_path, capsys, no_load):
    import re

    argv = ["analyze", TEXT, "--model", tiny, *[a.format(tmp=tmp_path) for a in args]]
    if "--out" not in args:
        argv += ["--out", tmp_path / "o"]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1, (out, err)
    assert re.search(match, err), err
    assert not (tmp_path / "o").exists()  # nothing made either


def _count_forwards(loaded, monkeypatch, ids) -> list:
    """Every forward of the model on the text's ids (other sections run their own inputs: the atlas's)."""
    seen, forward = [], loaded.adapter.forward

    def counting(inputs, *a, **k):
        got = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
        if isinstance(got, torch.Tensor) and got.shape == ids.shape and torch.equal(got, ids):
            seen.append(torch.is_grad_enabled())
        return forward(inputs, *a, **k)

    monkeypatch.setattr(loaded.adapter, "forward", counting)
    return seen


def test_full_mode_is_recorded_once_by_the_runner_for_the_union_of_the_sections_sites(
        tiny, loaded, reuse, tmp_path, capsys, monkeypatch):
    import headlab.interpret.capture as capture_pkg
    from headlab.interpret.report.sections.saliency import SaliencySection

    # the saliency strip runs gradient passes of its own by design (a recording holds no gradients): left out
    # here, so that every other forward on the text would be a second recording
    monkeypatch.setattr(SaliencySection, "active", lambda self, job: False)
    job, sections, _ = analyze_job.plan(loaded, TEXT, tmp_path)
    union = sorted({s for sec in sections for s in sec.sites(job)})
    assert job.mode == "full" and {"heads", "flow"} <= {s.name for s in sections}
    assert set(loaded.adapter.sites("pattern")) <= set(union) and set(loaded.adapter.sites("input")) <= set(union)

    calls, real = [], capture_pkg.capture

    def runner_capture(model, inputs, sites=None, **kw):
        calls.append(sorted(sites))
        return real(model, inputs, sites=sites, **kw)

    monkeypatch.setattr(capture_pkg, "capture", runner_capture)  # what the runner calls
    monkeypatch.setattr(analyze_job, "capture", lambda *a, **k: pytest.fail("the job recorded the text again"))
    forwards = _count_forwards(loaded, monkeypatch, job.inputs["input_ids"])
    code, out, err = run_cli(["analyze", TEXT, "--model", tiny, "--out", tmp_path / "r"], capsys)
    assert code == 0, err
    assert calls == [union]  # one recording, of every site the active sections declared
    assert forwards == [False]  # the model ran once on the text
    assert "mode full" in out and (tmp_path / "r" / "report.html").is_file()


def test_the_rows_report_is_the_librarys_whatever_the_backend_in_full_mode(tiny, loaded, reuse, tmp_path, capsys):
    """Full mode captures every map on the reference computation, so the row's recording and the library's own on
    the approximate backend give the same table, and the same notes."""
    headlab.analyze(TEXT, model=loaded, out_dir=tmp_path / "lib", backend="linear")
    code, out, err = run_cli(["analyze", TEXT, "--model", tiny, "--out", tmp_path / "row", "--backend", "linear"],
                             capsys)
    assert code == 0, err
    a, b = (json.loads((tmp_path / d / "heads.json").read_text()) for d in ("lib", "row"))
    assert a["heads"] == b["heads"] and a["notes"] == b["notes"] and a["mode"] == b["mode"] == "full"
    assert a["model_backend"] == b["model_backend"] == "linear" and "was not used" in out
    # and the table is the maps' own: the entropy of head 1.3 from a separate capture of its map
    pattern = headlab.capture(loaded, TEXT, sites=loaded.adapter.sites("pattern"))[loaded.adapter.site_name(1, "pattern")]
    p = pattern[0, 3].double()  # (L, L), causal rows
    entropy = float(-(p * torch.log(torch.where(p > 0, p, torch.ones_like(p)))).sum(-1).mean())
    rec = next(r for r in b["heads"] if (r["layer"], r["head"]) == (1, 3))
    assert rec["entropy"] == pytest.approx(entropy, rel=1e-4)


def test_streaming_mode_is_recorded_once_by_the_runner_with_the_sink_positions(tiny, loaded, reuse, tmp_path, capsys,
                                                                                monkeypatch):
    """Streaming mode's statistics need the sink positions and the job's backend: the instrument hands them to the
    runner (capture_options), which records once; the job's own recording is not used."""
    import headlab.interpret.capture as capture_pkg

    calls, real = [], capture_pkg.capture

    def runner_capture(model, inputs, sites=None, **kw):
        calls.append(kw)
        return real(model, inputs, sites=sites, **kw)

    monkeypatch.setattr(capture_pkg, "capture", runner_capture)
    monkeypatch.setattr(analyze_job, "capture", lambda *a, **k: pytest.fail("the job recorded a second time"))
    code, out, err = run_cli(["analyze", TEXT, "--model", tiny, "--out", tmp_path / "s", "--max-full-tokens", "3",
                              "--heads", "1.2", "--backend", "tiled", "--json"], capsys)
    assert code == 0, err
    assert len(calls) == 1 and calls[0]["stats_kwargs"]["key_positions"] == [0]  # a decoder: the first token sinks
    assert calls[0]["backend"] == "tiled" and "entropy" in calls[0]["stats_kwargs"]["stats"]
    js = json.loads(out)
    assert js["mode"] == "streaming" and js["drawn"] == ["1.2"] and js["tokens"] == loaded.encode(TEXT)["input_ids"].shape[1]


def test_ctrl_c_in_the_one_unit_says_nothing_was_kept(tiny, reuse, tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(analyze_job, "compute", interrupted)
    code, out, err = run_cli(["analyze", TEXT, "--model", tiny, "--out", tmp_path / "r"], capsys)
    assert code == 130
    assert "interrupted: kept 0 of 1 units nothing was written (no unit had finished)" in err
    assert not (tmp_path / "r" / "heads.json").exists() and not out


def test_the_runner_hands_back_the_envelope_heads_json_holds(loaded, reuse, tmp_path):
    from headlab.interpret.instruments import runner
    from headlab.results import Result

    outcome = runner.run("analyze", {"text": TEXT, "out": tmp_path / "e"}, progress=False)
    on_disk = Result.load(tmp_path / "e" / "heads.json")
    assert outcome.result.kind == on_disk.kind == "analyze"
    assert outcome.result.figures == on_disk.figures and outcome.result.settings == on_disk.settings
    assert outcome.result.native.records[0].as_dict() == on_disk.figures["heads"][0]
    assert sorted(p.name for p in outcome.files) == sorted(p.name for p in (tmp_path / "e").iterdir())


def test_a_memory_refusal_of_the_full_mode_recording_says_how_to_stream(tiny, reuse, tmp_path, capsys, monkeypatch):
    """The runner's recording refused by the memory guard: the instrument's words (recording_refused), with the
    length to stream at, not the guard's backend hint."""
    import headlab.interpret.capture as capture_pkg
    from headlab.errors import MemoryBudgetError

    def refuse(*a, **k):
        raise MemoryBudgetError("the maps need 9.0 GiB, 1.0 GiB is free; use backend='tiled'", estimate_bytes=9 << 30,
                                available_bytes=1 << 30, alternative="tiled")

    monkeypatch.setattr(capture_pkg, "capture", refuse)
    code, out, err = run_cli(["analyze", TEXT, "--model", tiny, "--out", tmp_path / "m"], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # after the progress lines
    assert code == 2 and len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert "the report's full mode holds every" in errors[0] and "--max-full-tokens 11" in errors[0]
    assert "backend=" not in errors[0]
