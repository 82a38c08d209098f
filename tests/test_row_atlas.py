"""``headlab atlas`` is a row: the ``atlas`` instrument's options are the command's (the flags, short flags and
defaults it has always had), a bad option is refused before any model loads, what the row writes is what
``headlab.atlas`` computes on the same model, and Ctrl-C keeps the finished phases (the runner's units), from
which the printed command (``--resume``) runs only the rest, to the uninterrupted result."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import command_params, run_cli
from headlab.interpret.atlas import Atlas
from headlab.interpret.instruments import get, runner
from headlab.models.transformer import Transformer, TransformerConfig

# the command's options as they were before it became a row: (python name, flags, default)
OPTIONS = [("model", {"--model", "-m"}, "minilm"), ("kinds", {"--kinds", "-k"}, None), ("texts", {"--texts"}, None),
           ("treebank", {"--treebank", "-t"}, None), ("out", {"--out", "-o"}, None), ("force", {"--force"}, False),
           ("checks", {"--checks"}, True), ("top_k", {"--top-k"}, None), ("draws", {"--draws"}, 10),
           ("half", {"--half"}, 50), ("n_texts", {"--n-texts"}, 4), ("max_tokens", {"--max-tokens"}, 128),
           ("needles", {"--needles"}, 4), ("haystack", {"--haystack"}, 256), ("seed", {"--seed"}, 0),
           ("as_json", {"--json"}, False)]
SIZES = ["--half", "6", "--max-tokens", "24", "--n-texts", "3", "--needles", "3", "--haystack", "30", "--top-k", "2",
         "--draws", "4"]
LIBRARY = dict(k=2, n_draws=4, half=6, max_tokens=24, n_texts=3, needle_trials=3, haystack_tokens=30, seed=0)


@pytest.fixture()
def saved_decoder(tmp_path):
    torch.manual_seed(1)
    m = Transformer(TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True))
    return m.eval().save(tmp_path / "tiny")


@pytest.fixture()
def ids_file(tmp_path):
    p = tmp_path / "ids.txt"
    g = torch.Generator().manual_seed(0)
    p.write_text("\n".join(" ".join(str(int(x)) for x in torch.randint(1, 40, (40,), generator=g))
                           for _ in range(4)) + "\n")
    return p


def test_the_command_is_the_instruments_row():
    inst = get("atlas")
    assert type(inst).__name__ == "HeadAtlas" and inst.result_kind == "head_atlas"
    params = command_params("atlas")
    cli = [o for o in inst.options if not o.python]  # headlab.atlas()'s own settings and inputs have no flag
    assert set(params) == {o.name for o in cli} | {"tensor_parallel", "tensor_size", "resume"}
    assert [o.name for o in cli] == [name for name, _, _ in OPTIONS]
    for name, flags, default in OPTIONS:
        p = params[name]
        assert set(p.opts) == flags and p.default == default, name
        assert inst.option(name).default in (default, ...)
    assert params["checks"].secondary_opts == ["--no-checks"] and params["out"].required


@pytest.mark.parametrize("options,match", [
    ({"draws": 0}, r"--draws must be at least 1, got 0"),
    ({"kinds": "previous_token,bogus"}, r"--kinds: unknown 'bogus'; choose from previous_token"),
    ({"kinds": "syntactic"}, r"--kinds syntactic needs --treebank FILE.conllu"),
    ({"half": 300}, r"--half 300: the repeated sequences are 2 x 300 tokens plus the special tokens, past the 512 "
                    r"positions of minilm; give --half 255"),
    ({"max_tokens": 513}, r"--max-tokens 513 is past the 512 positions of minilm"),
])
def test_bad_options_are_refused_before_the_load(options, match, tmp_path, no_load, capsys):
    from headlab.errors import HeadlabError

    with pytest.raises(HeadlabError, match=match):
        runner.run("atlas", {"out": tmp_path / "o", **options}, progress=False)
    flags = [x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    code, _, err = run_cli(["atlas", "--out", tmp_path / "o", *flags], capsys)
    assert code == 2 and err.count("\n") == 1 and "error:" in err
    assert not (tmp_path / "o").exists()


def test_the_row_writes_what_the_library_computes(tmp_path, saved_decoder, ids_file, capsys):
    import headlab
    from headlab.interpret.instruments.atlas import _ids_if_needed

    code, so, se = run_cli(["atlas", "--model", saved_decoder, "--texts", ids_file, "--out", tmp_path / "out",
                            "--kinds", "induction,sink", *SIZES], capsys)
    assert code == 0, se
    got = Atlas.from_json(tmp_path / "out" / "atlas.json")
    loaded = headlab.load(saved_decoder)
    want = headlab.atlas(loaded, kinds=["induction", "sink"], texts=_ids_if_needed(loaded, [ids_file.read_text()]),
                         **LIBRARY)
    assert got.kinds == want.kinds == ["induction", "sink"]
    for kind in want.scores:
        assert torch.allclose(got.scores[kind], want.scores[kind].double(), atol=1e-9, equal_nan=True), kind
    assert {k: v["verdict"] for k, v in got.verdicts.items()} == {k: v["verdict"] for k, v in want.verdicts.items()}
    assert f"wrote: {tmp_path / 'out' / 'atlas.json'}, {tmp_path / 'out' / 'atlas.html'}" in " ".join(so.split())
    assert "induction" in so and "sink" in so


def test_ctrl_c_keeps_the_finished_phases_and_the_printed_command_resumes(tmp_path, saved_decoder, ids_file, capsys,
                                                                         monkeypatch):
    import shlex

    import headlab.interpret.atlas.kinds.retrieval as retrieval

    real, calls = retrieval.retrieval_trial, []

    def second_trial_interrupted(adapter, trial):
        calls.append(trial)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C while the second needle trial decodes
        return real(adapter, trial)

    monkeypatch.setattr(retrieval, "retrieval_trial", second_trial_interrupted)
    out = tmp_path / "out"
    args = ["atlas", "--model", saved_decoder, "--texts", ids_file, "--out", out, "--kinds", "induction,retrieval",
            *SIZES]
    code, _, se = run_cli(args, capsys)
    phases = ["repeated", "copying", "text", "retrieval", "check repeated", "check needle", "evidence"]
    assert code == 130 and f"interrupted: kept 3 of {len(phases)} units in {out / 'atlas.json'}" in se, se
    partial = json.loads((out / "atlas.json").read_text())  # the runner's units: what had finished, nothing more
    assert partial["interrupted"] == {"kept": 3, "of": len(phases)}
    assert list(partial["units"]) == ["repeated", "copying", "text"] and not (out / "atlas.html").exists()
    command = [ln for ln in se.splitlines() if ln.startswith("interrupted")][0].split("to finish the rest: ", 1)[1]
    assert command.startswith("headlab atlas ") and command.endswith(" --resume"), command

    monkeypatch.setattr(retrieval, "retrieval_trial", lambda adapter, trial: calls.append(trial) or real(adapter, trial))
    calls.clear()
    ran, real_unit = [], type(get("atlas")).run_unit
    monkeypatch.setattr(type(get("atlas")), "run_unit",
                        lambda self, ctx, unit, recording=None: ran.append(unit.key) or real_unit(self, ctx, unit))
    code, _, se = run_cli(shlex.split(command)[1:], capsys)  # the printed line, as a user would paste it
    assert code == 0, se
    assert ran == phases[3:] and len(calls) == 3, ran  # only the rest ran (the three needle trials among them)
    resumed = Atlas.from_json(out / "atlas.json")
    assert any(n.startswith("resumed: repeated, copying, text read back") for n in resumed.notes), resumed.notes
    code, _, se = run_cli(["atlas", "--model", saved_decoder, "--texts", ids_file, "--out", tmp_path / "fresh",
                           "--kinds", "induction,retrieval", *SIZES], capsys)
    assert code == 0, se
    fresh = Atlas.from_json(tmp_path / "fresh" / "atlas.json")
    for kind in fresh.scores:  # resumed from the kept phases = computed in one go
        assert torch.allclose(resumed.scores[kind], fresh.scores[kind], atol=1e-12, equal_nan=True), kind
    assert resumed.verdicts == fresh.verdicts
    assert resumed.settings["needle_runs"] == fresh.settings["needle_runs"]
    assert resumed.evidence == fresh.evidence
