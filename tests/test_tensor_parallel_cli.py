"""The command line on a model sharded by tensor parallelism: ``torchrun -m headlab ... --tensor-parallel``.

Two local gloo ranks (tests/workers/tp_cli_worker.py, started by torchrun on 127.0.0.1) run ``analyze``, ``flow``,
``heads importance``, ``probe``, ``patch``, ``generate`` and ``explain --dataset`` through the CLI's entry point with
``--tensor-parallel`` (the study runner loads the model sharded by heads with transformers' plan; rank 0 writes);
the same commands run here in one process on the unsharded model, and every file they write is compared: numbers
to 1e-5 (float32), everything else exactly, only times, versions and the paths themselves set aside. The
one-process files are the independent computation, and they depend on the head order (checked), so a rank that
wrote its own heads only, or in the wrong order, would fail. The explain study includes the adversarial attention
search, whose gradient on a sharded model must be added over the ranks' heads (it diverged without that).
"""

from __future__ import annotations

import json
import re
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import save_word_level
from test_tensor_parallel import run_world

WORKER = Path(__file__).parent / "workers" / "tp_cli_worker.py"
sys.path.insert(0, str(WORKER.parent))
import tp_cli_worker  # noqa: E402

# the files each command writes that hold its figures (pictures and pages are drawn from them)
FILES = {"analyze": ["analyze/heads.json", "analyze/saliency.json"], "flow": ["flow/norms.json"],
         "importance": ["importance/importance.json"], "probe": ["probe/relations.json"], "patch": ["patch.json"],
         "generate": ["generate.json"], "explain": ["explain/instances.json", "explain/study.json"]}
SET_ASIDE = {"version", "out_dir", "path", "dataset", "treebank", "data", "model", "files", "out", "elapsed",
             "time_ratio", "kv_bytes_per_rank"}  # the last: None in one process (checked below)


def _model(path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64)
    return save_word_level(path, transformers.LlamaForCausalLM(cfg), ["<pad>", "<unk>"] + tp_cli_worker.WORDS)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tpcli")
    model = _model(tmp / "model")
    torch.set_num_threads(1)
    codes = run_world(2, model, tmp / "tp", torchrun=True, worker=WORKER, timeout=900)
    from headlab.cli.main import main

    one = {}
    files = tp_cli_worker.inputs(tmp / "one" / "inputs")
    for name, args in tp_cli_worker.commands(str(model), tmp / "one", files).items():
        try:
            main(args)
            one[name] = 0
        except SystemExit as e:
            one[name] = e.code
    return codes, one, tmp / "tp", tmp / "one"


def _read(path: Path):
    if path.suffix == ".jsonl":
        return sorted((json.loads(line) for line in path.read_text().splitlines() if line.strip()),
                      key=lambda r: r.get("key", ""))
    return json.loads(path.read_text())


def _same(got, ref, where: str, diffs: list) -> None:
    if isinstance(ref, dict):
        assert sorted(got) == sorted(ref), where
        for k in ref:
            if k not in SET_ASIDE and not k.endswith(("seconds", "per_second")):  # times
                _same(got[k], ref[k], f"{where}.{k}", diffs)
    elif isinstance(ref, list):
        assert isinstance(got, list) and len(got) == len(ref), where
        for i, (a, b) in enumerate(zip(got, ref)):
            _same(a, b, f"{where}[{i}]", diffs)
    elif isinstance(ref, float) or isinstance(got, float):
        if ref is None or got is None or (math.isnan(ref) and math.isnan(got)):
            assert got is ref or (math.isnan(ref) and math.isnan(got)), where
            return
        assert math.isclose(got, ref, abs_tol=1e-5, rel_tol=1e-5), (where, got, ref)
        diffs.append(abs(got - ref))
    elif isinstance(ref, str) and ("/" in ref or "\\" in ref):
        return  # a path of this run
    else:
        assert got == ref, (where, got, ref)


@pytest.mark.distributed
@pytest.mark.parametrize("command", list(FILES))
def test_each_command_under_tensor_parallelism_writes_one_process_s_files(both, command):
    codes, one, tp, ref = both
    assert one[command] == 0, f"{command} failed in one process"
    assert all(c[command] == 0 for c in codes), (command, codes)
    for name in FILES[command]:
        diffs: list[float] = []
        _same(_read(tp / name), _read(ref / name), name, diffs)
        assert diffs, f"{name}: no number compared"


@pytest.mark.distributed
def test_the_one_process_files_depend_on_the_head_order(both):
    """What makes the comparison a test: per-head figures differ between heads, so shards in another order (or a
    rank's own heads only) would disagree."""
    _, _, _, ref = both
    records = _read(ref / "analyze/heads.json")["heads"]
    assert len(records) == 8 and len({round(r["entropy"], 6) for r in records}) == 8
    imp = _read(ref / "importance/importance.json")
    flat = [x for row in imp["importance"] for x in row]
    assert len(set(round(x, 8) for x in flat)) == len(flat) == 8


@pytest.mark.distributed
def test_generate_reports_each_rank_s_cache_and_their_sum_is_one_process_s(both):
    _, _, tp, ref = both
    got, one = _read(tp / "generate.json"), _read(ref / "generate.json")
    assert one["kv_bytes_per_rank"] is None
    assert len(got["kv_bytes_per_rank"]) == 2 and sum(got["kv_bytes_per_rank"]) == one["kv_bytes"] == got["kv_bytes"]


@pytest.mark.parametrize("args,env,match", [
    (["--tensor-parallel", "--tensor-size", "0"], None, r"--tensor-size must be at least 1.*got 0"),
    (["--tensor-parallel", "--tensor-size", "-1"], None, r"--tensor-size must be at least 1.*got -1"),
    (["--tensor-size", "2"], None, r"--tensor-size acts only with --tensor-parallel"),
    (["--tensor-parallel"], None, r"launch with torchrun"),
    (["--tensor-parallel", "--tensor-size", "3"], "2", r"--tensor-size 3 does not divide the 2 ranks"),
])
def test_bad_tensor_parallel_options_end_in_one_line_before_the_load(args, env, match, no_load, monkeypatch, capsys):
    """A size of 0 would have read as "no tensor parallelism" and run unsharded without a word."""
    from conftest import run_cli

    if env is not None:
        monkeypatch.setenv("WORLD_SIZE", env)
    code, out, err = run_cli(["flow", "a b", *args], capsys)
    assert code == 2 and err.count("\n") == 1 and re.search(match, err), err
