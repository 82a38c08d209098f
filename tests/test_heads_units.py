"""The heads studies as the runner's units: ``heads importance`` is one unit per batch (its sums), ``heads ablate``
one per batch and phase, ``heads prune`` importance's units then the surgery and the curve. Each equals the
library function exactly on one process; Ctrl-C keeps the finished units (exit 130) and the printed command
resumes to the uninterrupted result, the label-free losses' draws included."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

import headlab
import headlab.cli.main  # noqa: F401  (every command, so every instrument, registered)
from conftest import run_cli
from headlab.interpret.heads.ablation import ablate
from headlab.interpret.heads.examples import read_texts, token_ids_if_needed
from headlab.interpret.heads.importance import importance_study
from headlab.interpret.heads.units import ImportanceUnits
from headlab.interpret.instruments import get, runner
from headlab.models.transformer import Transformer, TransformerConfig

V = 40


@pytest.fixture()
def saved(tmp_path):
    torch.manual_seed(1)
    path = tmp_path / "tiny"
    Transformer(TransformerConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True)).eval() \
        .save(path)
    return path


@pytest.fixture()
def ids(tmp_path):
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, V, (int(k),), generator=g) for k in torch.randint(4, 10, (7,), generator=g)]
    path = tmp_path / "ids.txt"
    path.write_text("\n".join(" ".join(str(int(x)) for x in t) for t in texts) + "\n")
    return path


def _texts(saved, ids):
    loaded = headlab.load(saved)
    return loaded, token_ids_if_needed(loaded, read_texts(ids)[0])


def _grids(r):
    return {f: torch.nan_to_num(getattr(r, f), nan=-1.0) for f in ("importance", "normalized", "confidence")}


def test_the_three_commands_have_no_lifecycle_of_their_own():
    for name in ("heads-importance", "heads-ablate", "heads-prune"):
        inst = get(name)
        assert inst.parallel == "units" and inst.display and inst.announce, name
    assert get("heads-importance").resumable and get("heads-ablate").resumable
    assert not get("heads-importance").chained and get("heads-ablate").chained  # pairs read every single effect


@pytest.mark.parametrize("loss", ["lm", "kl"])
def test_importance_units_equal_the_library_exactly(saved, ids, tmp_path, loss):
    loaded, texts = _texts(saved, ids)
    out = runner.run("heads-importance", {"model": str(saved), "data": ids, "batch_size": 2, "loss": loss,
                                          "out": tmp_path / "o"})
    assert out.total == 4  # 7 examples, 2 per batch
    ref = importance_study(loaded, texts, loss=loss, batch_size=2)
    got = out.result.native
    for f, grid in _grids(ref).items():
        assert torch.equal(_grids(got)[f], grid), f
    assert got.correlations == ref.correlations and got.n_examples == ref.n_examples == 7
    written = json.loads((tmp_path / "o" / "importance.json").read_text())
    assert list(written["units"]) == [f"batch {i}" for i in range(4)]
    assert all(u["rng"] is None for u in written["units"].values())  # a finished file keeps the sums alone


def test_ablation_units_equal_the_library_exactly(saved, ids, tmp_path):
    loaded, texts = _texts(saved, ids)
    out = runner.run("heads-ablate", {"model": str(saved), "data": ids, "batch_size": 2, "loss": "lm", "k": 3,
                                      "boot": 50, "out": tmp_path / "o"})
    # 7 examples in batches of 2 (the lone last joins the one before): 3 single, 3 pair batches and the CKA
    assert out.total == 7
    got, ref = out.result.native.to_json(), ablate(loaded, texts, loss="lm", k=3, n_boot=50, batch_size=2).to_json()
    got.pop("seconds"), ref.pop("seconds")
    assert got == ref


def test_prune_ranks_by_the_importance_units(saved, ids, tmp_path):
    loaded, texts = _texts(saved, ids)
    out = runner.run("heads-prune", {"model": str(saved), "data": ids, "batch_size": 2, "fraction": 0.25,
                                     "out": tmp_path / "o"})
    assert out.total == 5  # 4 importance batches, then the surgery
    from headlab.interpret.heads.importance import head_importance
    from headlab.interpret.heads.prune import order_heads

    order = order_heads(head_importance(loaded, texts, batch_size=2, normalize=True))
    assert sorted((int(l), h) for l, hs in out.result.figures["removed"].items() for h in hs) == sorted(order[:2])


@pytest.mark.parametrize("loss", ["lm", "kl"])
def test_ctrl_c_in_importance_keeps_units_exits_130_and_the_printed_command_resumes(saved, ids, tmp_path, capsys,
                                                                                   monkeypatch, loss):
    real, calls = ImportanceUnits.run, []

    def third_batch_interrupted(self, i, before=None):
        calls.append(i)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the third batch
        return real(self, i, before)

    monkeypatch.setattr(ImportanceUnits, "run", third_batch_interrupted)
    out = tmp_path / "o"
    args = ["heads", "importance", "--model", saved, "--data", ids, "--batch-size", "2", "--loss", loss, "--out", out]
    code, _, se = run_cli(args, capsys)
    assert code == 130 and f"interrupted: kept 2 of 4 units in {out / 'importance.json'}" in se, se
    partial = json.loads((out / "importance.json").read_text())
    assert partial["interrupted"] == {"kept": 2, "of": 4} and list(partial["units"]) == ["batch 0", "batch 1"]
    assert (partial["units"]["batch 1"]["rng"] is None) == (loss == "lm")  # kl: the draws go on from here
    assert not (out / "heads.html").exists()
    command = [ln for ln in se.splitlines() if ln.startswith("interrupted")][0].split("to finish the rest: ", 1)[1]
    assert command.startswith("headlab heads importance ") and command.endswith(" --resume"), command

    calls.clear()
    monkeypatch.setattr(ImportanceUnits, "run", lambda self, i, before=None: calls.append(i) or real(self, i, before))
    code, _, se = run_cli(shlex.split(command)[1:], capsys)  # the printed line, as a user would paste it
    assert code == 0, se
    assert calls == [2, 3]  # only the rest ran
    resumed = json.loads((out / "importance.json").read_text())
    assert "interrupted" not in resumed and (out / "heads.html").is_file()
    code, _, se = run_cli(args[:-1] + [tmp_path / "fresh"], capsys)
    assert code == 0, se
    fresh = json.loads((tmp_path / "fresh" / "importance.json").read_text())
    for f in ("importance", "normalized", "confidence", "correlations", "n_examples", "loss"):
        assert resumed[f] == fresh[f], f  # the same numbers, the kl draws included


def test_a_resume_with_other_settings_is_refused(saved, ids, tmp_path, capsys, monkeypatch):
    real = ImportanceUnits.run

    def second_batch_interrupted(self, i, before=None):
        if i == 1:
            raise KeyboardInterrupt
        return real(self, i, before)

    monkeypatch.setattr(ImportanceUnits, "run", second_batch_interrupted)
    out = tmp_path / "o"
    args = ["heads", "importance", "--model", saved, "--data", ids, "--batch-size", "2", "--out", out]
    assert run_cli(args, capsys)[0] == 130
    code, _, se = run_cli([*args[:-3], "3", "--out", out, "--resume"], capsys)
    assert code == 2 and "other settings (batch_size)" in se, se


@pytest.mark.distributed
def test_under_torchrun_the_runner_s_split_gives_one_process_s_files(saved, ids, tmp_path, capsys):
    """2 gloo ranks (torchrun, 127.0.0.1): importance's batches split across the ranks, the ablation's and the
    pruning's chained units on the first; every number in the files equals one process's (the same batches, added
    in the same order), the pruning curve recomputing importance on the first rank alone (no collective waits)."""
    import sys
    from pathlib import Path

    from test_tensor_parallel import run_world

    worker = Path(__file__).parent / "workers" / "heads_dp_worker.py"
    sys.path.insert(0, str(worker.parent))
    import heads_dp_worker

    (saved.parent / "ids.txt").write_text(ids.read_text())
    codes = run_world(2, saved, tmp_path / "dp", torchrun=True, worker=worker, timeout=600)
    assert all(c == {"importance": 0, "ablate": 0, "prune": 0} for c in codes), codes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (OMP_NUM_THREADS=1): a product's sums split alike on any CPU
    try:
        for args in heads_dp_worker.commands(str(saved), saved.parent / "ids.txt", tmp_path / "one").values():
            assert run_cli(args, capsys)[0] == 0
    finally:
        torch.set_num_threads(threads)
    for name in ("importance/importance.json", "ablate/ablation.json", "prune/curve.json"):
        got, one = (json.loads((tmp_path / w / name).read_text()) for w in ("dp", "one"))
        for d in (got, one):
            d.pop("seconds", None), d.pop("version", None)
            for u in d.get("units", {}).values():
                u.pop("seconds", None)
        assert got == one, name
    assert sorted(p.name for p in (tmp_path / "dp" / "prune").iterdir()) == \
        sorted(p.name for p in (tmp_path / "one" / "prune").iterdir())
