"""Results are JSON (issue 39, item 7): one writer that writes standard JSON only, one reader that checks the header.

Every check reads the written file back with the standard ``json`` module, refusing the non-standard constants
(``NaN``, ``Infinity``, ``-Infinity``) that ``json.loads`` would otherwise accept."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from headlab import results as R
from headlab._version import __version__
from headlab.errors import HeadlabError, InputError


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"the file holds a bare {name}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


def _written(tmp_path, obj, **kw):
    path = R.write_json(tmp_path / "r.json", obj, **kw)
    return _strict(path.read_text(encoding="utf-8"))


# ---- NaN, inf, -inf: null, with a note saying where -------------------------------------------------


def test_nan_and_inf_in_nested_figures_are_null_with_notes(tmp_path):
    r = R.Result("edge_scores", model="m", figures={"scores": [0.5, math.nan, 2.0], "by_layer": {
        "0": {"top": math.inf, "low": [-math.inf, 1.0]}}, "ok": 1.25})
    doc = _strict(r.save(tmp_path / "r.json").read_text())
    assert doc["scores"] == [0.5, None, 2.0] and doc["by_layer"] == {"0": {"top": None, "low": [None, 1.0]}}
    assert doc["ok"] == 1.25
    assert doc["headlab"]["notes"] == ["scores[1] was NaN, written as null", "by_layer.0.top was inf, written as null",
                                       "by_layer.0.low[0] was -inf, written as null"]
    back = R.Result.load(tmp_path / "r.json")
    assert back.notes == doc["headlab"]["notes"] and back.figures["scores"] == [0.5, None, 2.0]
    assert _strict(back.save(tmp_path / "again.json").read_text())["headlab"]["notes"] == back.notes  # kept


def test_a_clean_result_has_no_notes(tmp_path):
    doc = _written(tmp_path, R.Result("patching", figures={"clean": 1.5}).to_json())
    assert "notes" not in doc["headlab"] and R.NOTES_KEY not in doc


def test_many_values_written_as_null_are_counted_per_path(tmp_path):
    grid = [[math.nan] * 4, [1.0, math.inf, math.nan, -math.inf]]
    doc = _written(tmp_path, R.envelope("head_atlas", {"z": grid, "y": [math.nan, 0.0]}))
    assert doc["z"] == [[None] * 4, [1.0, None, None, None]] and doc["y"] == [None, 0.0]
    assert doc["headlab"]["notes"] == ["z[*][*]: 5 NaN, 1 inf, 1 -inf, written as null",
                                       "y[*]: 1 NaN, written as null"]


def test_notes_outside_an_envelope(tmp_path):
    doc = _written(tmp_path, {"key": "k", "seconds": math.nan})  # an object without the header
    assert doc == {"key": "k", "seconds": None, R.NOTES_KEY: ["seconds was NaN, written as null"]}
    with pytest.warns(RuntimeWarning, match=r"\[1\]\.ms was inf"):  # a list has no place for them
        path = R.write_json(tmp_path / "rows.json", [{"ms": 1.0}, {"ms": math.inf}])
    assert _strict(path.read_text()) == [{"ms": 1.0}, {"ms": None}]


def test_numpy_float_nan_and_header_settings_are_caught(tmp_path):
    doc = _written(tmp_path, R.Result("probe", settings={"lr": np.float64("nan")}, figures={}).to_json())
    assert doc["headlab"]["settings"] == {"lr": None}
    assert doc["headlab"]["notes"] == ["headlab.settings.lr was NaN, written as null"]


def test_print_json_writes_standard_json(capsys):
    R.print_json({"headlab": {"kind": "k", "version": __version__}, "x": [math.nan, torch.tensor(2.0)]})
    doc = _strict(capsys.readouterr().out)
    assert doc["x"] == [None, 2.0] and doc["headlab"]["notes"] == ["x[0] was NaN, written as null"]


# ---- tensors and arrays are lists and numbers, not their str() -------------------------------------


@pytest.mark.parametrize("value, want", [
    (torch.tensor(1.5), 1.5),
    (torch.tensor([1.0, 2.0]), [1.0, 2.0]),
    (torch.tensor([[1, 2], [3, 4]]), [[1, 2], [3, 4]]),
    (torch.tensor([True, False]), [True, False]),
    (torch.tensor([1.0, 2.0], dtype=torch.bfloat16), [1.0, 2.0]),
    (torch.tensor([1.0, 2.0], requires_grad=True) * 2, [2.0, 4.0]),
    (np.arange(3), [0, 1, 2]),
    (np.array([[0.5, 1.0]], dtype=np.float32), [[0.5, 1.0]]),
    (np.int64(7), 7),
    (np.float32(0.25), 0.25),
    (np.bool_(True), True),
    ((1, (2, 3)), [1, [2, 3]]),
    (Path("/tmp/x.json"), "/tmp/x.json"),  # a path is its string, as before
])
def test_tensors_arrays_and_numpy_scalars_are_numbers(tmp_path, value, want):
    doc = _written(tmp_path, {"v": value})
    assert doc == {"v": want}
    assert type(doc["v"]) is type(want)  # 1.5 stays a float, 7 an int, True a bool


def test_a_tensor_with_nan_is_noted_too(tmp_path):
    doc = _written(tmp_path, R.envelope("rollout", {"rows": torch.tensor([[1.0, float("nan")], [float("-inf"), 0.0]])}))
    assert doc["rows"] == [[1.0, None], [None, 0.0]]
    assert doc["headlab"]["notes"] == ["rows[0][1] was NaN, written as null", "rows[1][0] was -inf, written as null"]
    assert "tensor(" not in json.dumps(doc)


def test_bools_stay_bools_and_ints_ints(tmp_path):
    doc = _written(tmp_path, {"flag": True, "off": False, "n": 3, "none": None, "keys": {1: "a", False: "b"}})
    assert doc["flag"] is True and doc["off"] is False and doc["n"] == 3 and type(doc["n"]) is int
    assert doc["none"] is None and doc["keys"] == {"1": "a", "false": "b"}


def test_numpy_keys_are_numbers(tmp_path):
    assert _written(tmp_path, {"heads": {np.int64(3): 1.0}}) == {"heads": {"3": 1.0}}


# ---- what JSON has no form for is refused, naming where -----------------------------------------------


@pytest.mark.parametrize("bad", [{3, 1, 2}, frozenset({"a"})])
def test_sets_are_refused_with_a_sorted_list_to_pass(tmp_path, bad):
    with pytest.raises(R.NotJSONError, match=r"figures\.heads\[1\] is a (frozen)?set .*pass a sorted list") as e:
        R.write_json(tmp_path / "r.json", {"figures": {"heads": [0, bad]}})
    assert e.value.path == "figures.heads[1]" and isinstance(e.value, (HeadlabError, TypeError))
    assert not (tmp_path / "r.json").exists()  # nothing written


class Opaque:
    pass


@pytest.mark.parametrize("bad, name", [(Opaque(), "Opaque"), (1 + 2j, "complex"), (torch.float32, "dtype"),
                                       (np.array([1j]), "complex"), (b"raw", "bytes")])
def test_other_objects_are_refused_not_strd(tmp_path, bad, name):
    with pytest.raises(R.NotJSONError, match=rf"settings\.x.* is a .*{name}.*no form for"):
        R.write_json(tmp_path / "r.json", {"settings": {"x": bad}})
    assert not (tmp_path / "r.json").exists()


def test_keys_that_are_no_strings_are_refused(tmp_path):
    with pytest.raises(R.NotJSONError, match=r"pairs has a key \(0, 1\) \(tuple\); JSON keys are strings"):
        R.write_json(tmp_path / "r.json", {"pairs": {(0, 1): 0.5}})


def test_a_loop_is_refused(tmp_path):
    loop: dict = {"a": 1}
    loop["self"] = loop
    with pytest.raises(R.NotJSONError, match="self holds itself"):
        R.write_json(tmp_path / "r.json", loop)


def test_a_tensor_without_values_is_refused(tmp_path):
    with pytest.raises(R.NotJSONError, match=r"^w is a tensor whose values cannot be read"):
        R.write_json(tmp_path / "r.json", {"w": torch.empty(2, device="meta")})


# ---- the reader checks the header's kind and version ---------------------------------------------------


def _file(tmp_path, doc, name="r.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_round_trip_through_writer_and_reader(tmp_path):
    r = R.Result("head_atlas", model="gpt2", settings={"layers": [0, 1], "out": Path("a/b")},
                 figures={"scores": torch.tensor([[0.5, 1.0]]), "n": np.int64(2), "ok": True})
    path = r.save(tmp_path / "atlas.json")
    _strict(path.read_text())
    back = R.Result.load(path, kind="head_atlas")
    assert (back.kind, back.model, back.version) == ("head_atlas", "gpt2", __version__)
    assert back.settings == {"layers": [0, 1], "out": "a/b"}
    assert back.figures == {"scores": [[0.5, 1.0]], "n": 2, "ok": True} and back.notes == []
    assert R.read_json(path, kind="head_atlas")["scores"] == [[0.5, 1.0]]


def test_the_reader_refuses_another_kind(tmp_path):
    path = R.Result("rollout", figures={"n": 3}).save(tmp_path / "r.json")
    with pytest.raises(R.ResultFileError, match=r"r\.json' holds a 'rollout' result, not 'patching'; give a patching"):
        R.Result.load(path, kind="patching", what="a patching result")
    old = _file(tmp_path, {"kind_of_result": "pruning_curve", "values": [1.0]}, "old.json")  # an earlier file's kind
    assert R.Result.load(old, kind="pruning_curve").kind == "pruning_curve"
    with pytest.raises(R.ResultFileError, match="holds a 'pruning_curve' result, not 'patching'"):
        R.read_json(old, kind="patching")


def test_the_reader_refuses_what_is_not_a_headlab_result(tmp_path):
    plain = _file(tmp_path, {"name": "package", "version": "1.0"}, "plain.json")
    assert R.read_json(plain) == {"name": "package", "version": "1.0"}  # any JSON when no kind is asked
    with pytest.raises(R.ResultFileError, match=r"plain\.json' is not a headlab result: it has no 'headlab' header"):
        R.Result.load(plain, kind="patching")
    with pytest.raises(R.ResultFileError, match="is not a headlab result: a JSON list, not an object"):
        R.read_json(_file(tmp_path, [1, 2], "list.json"), kind="patching")
    with pytest.raises(R.ResultFileError, match=r"not a headlab result: its 'headlab' header has no kind \(it has "
                                                r"'version'\)"):
        R.Result.load(_file(tmp_path, {"headlab": {"version": __version__}, "n": 1}, "nokind.json"))
    with pytest.raises(R.ResultFileError, match="header's version 2 is not a version string"):
        R.Result.load(_file(tmp_path, {"headlab": {"kind": "rollout", "version": 2}}, "badversion.json"))
    assert issubclass(R.ResultFileError, InputError)  # the CLI's one-line refusal, exit 2


def test_the_reader_refuses_a_newer_headlab(tmp_path):
    major, minor = (int(x) for x in __version__.split(".")[:2])
    newer = f"{major}.{minor + 1}.0" if major == 0 else f"{major + 1}.0.0"
    path = _file(tmp_path, {"headlab": {"kind": "rollout", "version": newer, "model": None, "settings": {}}, "n": 1})
    with pytest.raises(R.ResultFileError, match=rf"written by headlab {newer}, newer than this headlab "
                                                rf"\({__version__}\) reads; upgrade headlab"):
        R.Result.load(path)
    with pytest.raises(R.ResultFileError, match="newer than this headlab"):
        R.read_json(path)


@pytest.mark.parametrize("version", [__version__, "0.0.1", "0", "unknown", f"{__version__}.dev3+g1234",
                                     ".".join(__version__.split(".")[:2]) + ".99"])
def test_the_reader_reads_this_series_and_earlier(tmp_path, version):
    path = _file(tmp_path, {"headlab": {"kind": "rollout", "version": version, "model": "m", "settings": {}}, "n": 1})
    r = R.Result.load(path, kind="rollout")
    assert (r.kind, r.version, r.figures) == ("rollout", version, {"n": 1})


def test_earlier_files_with_bare_nan_still_read(tmp_path):
    (tmp_path / "old.json").write_text('{"kind_of_result": "pruning_curve", "values": [NaN, 1.0]}')
    r = R.Result.load(tmp_path / "old.json")
    assert r.kind == "pruning_curve" and math.isnan(r.figures["values"][0])


# ---- the module stays cheap to import ------------------------------------------------------------------


def test_the_writer_imports_neither_torch_nor_numpy():
    import ast

    tree = ast.parse(Path(R.__file__).read_text(encoding="utf-8"))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"torch", "numpy"}, imported  # tensors are recognised through sys.modules, not imported
    code = ("import sys, json, math, headlab.results as R; "
            "print(R.dumps({'a': [1, math.nan]}, indent=None)); "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert _strict(out[0]) == {"a": [1, None], R.NOTES_KEY: ["a[1] was NaN, written as null"]}
    if "torch" not in subprocess.run([sys.executable, "-c", "import sys, headlab; print(sorted(sys.modules))"],
                                     capture_output=True, text=True, check=True).stdout:
        assert out[1] == "[]"  # headlab itself is lazy: the results module adds no torch or numpy


def test_no_warning_for_clean_lists(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _strict(R.write_json(tmp_path / "rows.json", [{"ms": 1.0}]).read_text()) == [{"ms": 1.0}]
