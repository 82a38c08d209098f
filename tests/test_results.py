"""Results have one envelope and one writer (``headlab.results``), and output paths one check.

The envelope's header sits beside a result's own keys (earlier readers keep working), files of earlier
versions still load, a write is atomic, and no other module keeps an output check of its own."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

from headlab import results as R
from headlab._version import __version__
from headlab.errors import InputError

SRC = Path(__file__).resolve().parents[1] / "src" / "headlab"


def test_envelope_keeps_the_results_own_keys():
    d = R.envelope("patching", {"kind_of_result": "patching", "model": "m", "clean": 1.0}, model="m",
                   settings={"method": "exact"})
    assert d["headlab"] == {"kind": "patching", "version": __version__, "model": "m", "settings": {"method": "exact"}}
    assert d["kind_of_result"] == "patching" and d["clean"] == 1.0  # where earlier readers look
    assert R.envelope("other", d) is d  # a dict already in the envelope is kept as it is


def test_save_and_load_round_trip(tmp_path):
    r = R.Result("probe", model="minilm", settings={"limit": 5}, figures={"kind": "headlab.probe", "acc": [0.5]})
    path = r.save(tmp_path / "r.json")
    assert R.Result.load(path) == r
    assert json.loads(path.read_text())["kind"] == "headlab.probe"  # the result's own "kind" is untouched


@pytest.mark.parametrize("old, kind, model", [
    ({"kind_of_result": "pruning_curve", "model": "gpt2", "values": [1.0]}, "pruning_curve", "gpt2"),
    ({"kind": "headlab.probe", "model": "minilm"}, "probe", "minilm"),
    ({"kind": "single", "model": "m", "single": [[0.1]]}, "unknown", "m"),  # an ablation's kind is no envelope
    ({"tokens": ["a"], "rows": {}}, "unknown", None),
])
def test_files_of_earlier_versions_load(old, kind, model):
    r = R.Result.from_json(old)
    assert (r.kind, r.model, r.version, r.figures) == (kind, model, "unknown", old)


def test_repr_html_is_a_small_table():
    r = R.Result("patching", model="gpt2", settings={"method": "exact"}, figures={"effects": list(range(100))})
    page = r._repr_html_()
    assert page.startswith("<table>") and "patching" in page and "gpt2" in page and "settings.method" in page
    assert len(page) < 2000  # long figures are cut short


def test_the_writer_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    R.write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and path.read_text().endswith("\n")

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(R.os, "replace", boom)
    with pytest.raises(OSError, match="No space"):
        R.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}  # the earlier file is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary file left behind


def test_written_files_keep_the_usual_permissions(tmp_path):
    path = R.write_text(tmp_path / "x.txt", "x")
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask


def test_read_json_says_why_in_one_line(tmp_path):
    (tmp_path / "bad.json").write_bytes(b"{not json")
    (tmp_path / "latin.json").write_bytes(b"\xe9")
    for name, why in (("missing.json", "does not exist"), ("bad.json", "is not JSON"), ("latin.json", "not UTF-8")):
        with pytest.raises(InputError, match=why):
            R.read_json(tmp_path / name, what="a result")


def test_a_patch_result_is_in_the_envelope():
    import headlab
    from headlab.interpret.patching import logit_diff
    from headlab.models.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, causal=True)).eval()
    r = headlab.patch(m, torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]]), logit_diff(2, 5))
    d = json.loads(json.dumps(r.to_json()))
    back = R.Result.from_json(d)
    assert back.kind == "patching" and back.settings["method"] == "exact" and back.version == __version__
    assert d["kind_of_result"] == "patching" and len(d["effects"]["z"]) == 2


# the to_json of parts of a result (a pair's agreement, the study's options, a layer's norm summary) and of
# classes in rooms that keep their own for now are not whole results
PARTS = {"NormSummary", "PairAgreement", "Agreement", "StudyOptions", "Faithfulness"}
ELSEWHERE = {"AblationResult", "ImportanceResult", "Generation", "Policy", "GateTraining", "TrainingResult", "Verdict"}


def test_every_result_of_interpret_writes_the_envelope():
    missing = []
    for path in sorted((SRC / "interpret").rglob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(cls, ast.ClassDef) or cls.name in PARTS | ELSEWHERE:
                continue
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "to_json":
                    calls = {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
                    if "envelope" not in calls:
                        missing.append(f"{path.relative_to(SRC)}:{cls.name}")
    assert not missing, missing


def test_one_output_check():
    """The output checks live in headlab.outputs; the CLI's names are the same functions, and no other module
    words a refusal of a file in the folder's place itself."""
    from headlab import outputs
    from headlab.cli import app
    from headlab.interpret.probing import render

    assert app.check_output_dir is outputs.check_output_dir and app.check_output_file is outputs.check_output_file
    assert render.check_output_dir is outputs.check_output_dir
    own = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
           if p.name != "outputs.py" and ("is a file; give a folder" in p.read_text(encoding="utf-8")
                                          or "def check_output_dir" in p.read_text(encoding="utf-8"))]
    assert not own, own


def test_probe_folder_check_is_the_one_check(tmp_path):
    from headlab.interpret.probing.render import prepare_out_dir

    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match=r"--out '.*f/sub': '.*f' is a file, so no folder can be made under it"):
        prepare_out_dir(tmp_path / "f" / "sub")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(InputError, match="exists and is not empty.*--force"):
        prepare_out_dir(busy)
    assert prepare_out_dir(busy, force=True) == busy
