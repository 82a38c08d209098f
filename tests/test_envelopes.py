"""Every result in the one envelope: the heads' importance and ablation, a generation, a KV policy, trained gates, a
model's load-time verdict and a classifier's training record each write the header (kind, version, model,
settings) beside their own keys, read back through ``headlab.Result.load`` and their own ``load``, and files of
earlier versions (no header) still load. Also: a command line typer cannot parse ends in one line and exit 2, and
the ring's cost model refuses the lengths the ring kernel refuses."""

from __future__ import annotations

import ast
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import transformers

import headlab
from conftest import run_cli
from headlab import kv
from headlab.errors import InputError, ShapeError
from headlab.models.transformer import Transformer, TransformerConfig
from headlab.results import HEADER, Result, envelope

ROOT = Path(__file__).resolve().parents[1]
V = 40


def _texts(n=6):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V, (int(k),), generator=g) for k in torch.randint(4, 10, (n,), generator=g)]


def _decoder():
    torch.manual_seed(1)
    return Transformer(TransformerConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True)).eval()


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, attn_implementation="eager")).eval()


def _header(doc: dict, kind: str, model) -> dict:
    head = doc[HEADER]
    assert head["kind"] == kind and head["model"] == model and head["version"] == headlab.__version__
    assert sum(isinstance(v, dict) and "version" in v and "kind" in v for v in doc.values()) == 1  # one header
    return head


def _old(doc: dict) -> dict:
    """The file an earlier version wrote: the same keys, no header."""
    return {k: v for k, v in doc.items() if k != HEADER}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    assert (a is None) == (b is None)
    if a is not None:
        torch.testing.assert_close(b, a.float(), equal_nan=True, atol=1e-7, rtol=1e-6)


@pytest.fixture(scope="module")
def heads_results():
    m = _decoder()
    texts = _texts()
    ab = headlab.ablate(m, texts, k=3, n_boot=50)
    from headlab.interpret.heads.importance import importance_study

    imp = importance_study(m, texts, single_effects=ab.single)
    return ab, imp


def test_ablation_writes_the_envelope_and_reads_back(heads_results, tmp_path):
    from headlab.interpret.heads.ablation import AblationResult

    ab, _ = heads_results
    doc = json.loads(json.dumps(ab.to_json()))
    head = _header(doc, "head_ablation", "Transformer")
    assert head["settings"] == {"kind": "zero", "mean_over": None, "loss": ab.loss}
    assert doc["kind"] == "zero" and doc["kind_of_result"] == "head_ablation"  # the keys old readers use stay
    r = Result.load(ab.save(tmp_path / "ablation.json"))
    assert (r.kind, r.model, r.settings) == ("head_ablation", "Transformer", head["settings"])
    assert r.figures == _old(doc)
    for source in (tmp_path / "ablation.json", _write(tmp_path / "old.json", _old(doc))):
        back = AblationResult.load(source)
        for name in ("single", "single_ci", "keep_one", "keep_one_ci", "pair_effect", "interaction", "interaction_ci",
                     "cka"):
            _same(getattr(ab, name), getattr(back, name))
        assert [asdict(v) for v in back.verdicts] == [asdict(v) for v in ab.verdicts]
        assert back.pair_heads == ab.pair_heads and back.counts() == ab.counts()
        assert back.threshold == ab.threshold and back.floor_text() == ab.floor_text()
    assert Result.load(tmp_path / "old.json").kind == "head_ablation"  # from "kind_of_result"
    with pytest.raises(InputError, match="not an ablation result"):
        AblationResult.load(_write(tmp_path / "other.json", {"model": "m"}))


def test_importance_writes_the_envelope_and_reads_back(heads_results, tmp_path):
    from headlab.interpret.heads.importance import ImportanceResult

    _, imp = heads_results
    doc = json.loads(json.dumps(imp.to_json()))
    head = _header(doc, "head_importance", "Transformer")
    assert head["settings"] == {"loss": imp.loss} and doc["kind"] == "head_importance"
    assert set(imp.correlations) == {"importance~confidence", "importance~ablation", "confidence~ablation"}
    r = Result.load(imp.save(tmp_path / "importance.json"))
    assert (r.kind, r.model) == ("head_importance", "Transformer") and r.figures == _old(doc)
    old = _write(tmp_path / "old.json", _old(doc))
    assert Result.load(old).kind == "head_importance"  # an earlier file named its kind in "kind" alone
    for source in (tmp_path / "importance.json", old):
        back = ImportanceResult.load(source)
        _same(imp.importance, back.importance)
        _same(imp.normalized, back.normalized)
        _same(imp.confidence, back.confidence)
        assert back.ranking() == imp.ranking() and back.correlations == imp.correlations


def test_the_cli_wrapping_of_an_enveloped_result_is_a_no_op(heads_results, tmp_path, capsys):
    """Whoever writes these files may still wrap ``to_json()`` in ``envelope(...)`` (the heads instruments behind
    ``headlab heads importance|ablate`` do): that returns the document as it is, so the file the command writes
    carries one header, the result's own."""
    ab, imp = heads_results
    for r, kind in ((ab, "head_ablation"), (imp, "head_importance")):
        doc = r.to_json()
        assert envelope(kind, doc, model="another", settings={"x": 1}) is doc
    saved = tmp_path / "tiny"
    _decoder().save(saved)
    data = tmp_path / "ids.txt"
    data.write_text("\n".join(" ".join(str(int(x)) for x in t) for t in _texts()) + "\n")
    code, _, err = run_cli(["heads", "importance", "--model", saved, "--data", data, "--out", tmp_path / "o"], capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / "o" / "importance.json").read_text())
    head = _header(doc, "head_importance", str(saved))
    assert head["settings"] == {"loss": doc["loss"]} and len(doc["importance"]) == 2


def test_a_generation_writes_the_envelope_with_its_model_and_settings(tmp_path):
    lm = _llama()
    policy = kv.Policy.uniform(kv.window(sink=2, recent=6))
    g = headlab.generate(lm, torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(0)), policy=policy,
                         max_new_tokens=4, stop_at_eos=False)
    doc = json.loads(json.dumps(g.to_json()))
    head = _header(doc, "generation", "LlamaForCausalLM")
    assert head["settings"] == {"policy": policy.name, "max_new_tokens": 4, "sample": False, "stop_at_eos": False}
    assert doc["policy"] == {"name": policy.name, "default": "window:2,6", "heads": {}}  # nested plain, no header
    # the figures are the generation's: 4 tokens, and 2 layers x 2 kv heads x 8 keys x (k, v) x dim 8 x 4 bytes
    assert doc["ids"] == g.ids[0].tolist() and len(doc["ids"]) == 4 and doc["kv_bytes"] == 2 * 2 * 8 * 2 * 8 * 4
    r = Result.load(g.save(tmp_path / "g.json"))
    assert (r.kind, r.model) == ("generation", "LlamaForCausalLM") and r.figures == _old(doc)
    sampled = headlab.generate(lm, torch.tensor([[1, 2, 3]]), max_new_tokens=2, sample=True, temperature=0.5,
                               top_k=5, seed=3)
    assert sampled.to_json()[HEADER]["settings"] == {"policy": "full", "max_new_tokens": 2, "sample": True,
                                                     "stop_at_eos": True, "temperature": 0.5, "top_k": 5, "seed": 3}


def test_a_policy_file_has_the_envelope_and_old_files_still_load(tmp_path, capsys):
    from headlab.decode.instrument import read_policy_file

    p = kv.Policy.from_spec({(0, 1): kv.window(sink=1, recent=2), (1, 0): kv.drop}, default=kv.full(bits=8))
    doc = json.loads(json.dumps(p.to_json()))
    _header(doc, "kv_policy", None)
    assert _old(doc) == p.as_dict() == {"name": p.name, "default": "full:bits=8,group=32,residual=128",
                                        "heads": {"0.1": "window:1,2", "1.0": "drop"}}
    new, old = p.save(tmp_path / "new.json"), _write(tmp_path / "old.json", p.as_dict())
    for path in (new, old):
        back = kv.Policy.load(path)
        assert back.rules == p.rules and back.default == p.default and back.name == p.name
        assert "heads" in read_policy_file(path)  # what --kv-from dispatches on
    assert Result.load(new).kind == "kv_policy"
    (tmp_path / "latin.json").write_bytes(b"\xe9")
    with pytest.raises(InputError, match="is not JSON: not UTF-8 text"):
        kv.Policy.load(tmp_path / "latin.json")


def test_trained_gates_have_the_envelope_and_the_benchmark_file_still_loads(tmp_path):
    from headlab.decode.train import GateTraining, train_gates

    data = [(torch.randint(0, 61, (1, 24), generator=torch.Generator().manual_seed(i)), torch.arange(16, 23))
            for i in range(2)]
    t = train_gates(_llama(), data=data, rest=kv.window(2, 8), steps=2, progress=False)
    assert t.model == "LlamaForCausalLM"
    doc = json.loads(json.dumps(t.to_json()))
    head = _header(doc, "kv_gates", "LlamaForCausalLM")
    assert head["settings"] == {**t.settings, "rest": {"sink": 2, "recent": 8}} and t.settings["steps"] == 2
    assert doc["kind"] == "headlab.kv.gates" and doc["gates"] == t.gates.tolist()
    back = GateTraining.load(t.save(tmp_path / "g.json"))
    assert torch.equal(back.gates, t.gates) and back.rest == t.rest and back.model == t.model
    assert back.losses == t.losses and back.settings == t.settings
    old = ROOT / "benchmarks" / "results" / "kv_gates.json"  # written before the envelope
    raw = json.loads(old.read_text())
    assert HEADER not in raw
    g = GateTraining.load(old)
    assert g.model == raw["model"] == "smollm2" and g.gates.tolist() == raw["gates"] and g.steps == raw["steps"]
    r = Result.load(old)
    assert (r.kind, r.model) == ("kv_gates", "smollm2")  # "headlab.kv.gates" reads as this version's kind


def test_a_load_time_verdict_has_the_envelope_and_reads_back(tmp_path):
    from headlab.models.hf.verdict import Check, Verdict

    v = Verdict("glm4", "llama", True, [Check("pattern", True, 1e-7, 1e-4, "maps"), Check("output", False, 0.3, 1e-4)],
                1.5, ["a note"])
    doc = json.loads(json.dumps(v.to_json()))
    head = _header(doc, "load_check", "glm4")
    assert head["settings"] == {"family": "llama", "by_structure": True}
    assert Verdict.from_json(doc) == v and Verdict.from_json(_old(doc)) == v  # the checks too
    assert Verdict(**{**doc, "checks": []}).model_type == "glm4"  # how callers built one before the envelope
    assert not Verdict.from_json(doc).passed and Verdict.from_json(doc).failed.name == "output"
    assert Result.from_json(doc).kind == "load_check"


def test_a_training_record_has_the_envelope_and_old_records_load(tmp_path):
    from headlab.models.finetune import TrainingConfig, TrainingResult

    cfg = TrainingConfig(batch_size=4, subset=0, lr=5e-4)
    r = TrainingResult(tmp_path / "clf", 0.9, 10, 20, 5, 1.5, 2.0, cfg, [{"step": 5, "validation_accuracy": 0.9}])
    doc = json.loads(json.dumps(r.to_json()))
    head = _header(doc, "classifier_training", "all-MiniLM-L6-v2")
    assert head["settings"] == asdict(cfg) and head["settings"]["lr"] == 5e-4
    assert doc["out"] == str(tmp_path / "clf") and doc["config"]["batch_size"] == 4
    folder = tmp_path / "clf"
    folder.mkdir()
    record = {**doc, "torch": torch.__version__, "date": "2026-12-03 12:00:00"}  # as train_classifier writes it
    _write(folder / "headlab-training.json", record)
    assert TrainingResult.load(folder) == r
    _write(tmp_path / "old.json", {k: v for k, v in record.items() if k not in (HEADER, "model")})
    assert TrainingResult.load(tmp_path / "old.json") == r
    assert Result.load(folder / "headlab-training.json").kind == "classifier_training"


def test_every_result_class_here_calls_the_envelope():
    """The classes test_results.py lists as keeping their own JSON now write the envelope themselves."""
    where = {"interpret/heads/ablation.py": "AblationResult", "interpret/heads/importance.py": "ImportanceResult",
             "decode/generate.py": "Generation", "decode/policy.py": "Policy", "decode/train.py": "GateTraining",
             "models/finetune.py": "TrainingResult", "models/hf/verdict.py": "Verdict"}
    for rel, name in where.items():
        tree = ast.parse((ROOT / "src" / "headlab" / rel).read_text(encoding="utf-8"))
        cls = next(c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == name)
        fn = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "to_json")
        calls = {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "envelope" in calls, f"{rel}:{name}"


def test_result_is_exported_from_the_package():
    assert headlab.Result is Result and "Result" in headlab.__all__
    assert headlab.read_json is headlab.results.read_json and headlab.write_json is headlab.results.write_json


# -- a command line typer cannot parse: one line, exit 2 --------------------------------------------------------
@pytest.mark.parametrize("args, said, where", [
    (["heads", "importance", "--top", "x"], "No such option: --top", "headlab heads importance"),
    (["heads", "ablate", "--k", "x"], "Invalid value for '--k'", "headlab heads ablate"),
    (["generate"], "Missing argument 'prompt'", "headlab generate"),
    (["nosuch"], "No such command 'nosuch'", "headlab"),
    (["memory", "--seq-len", "many"], "Invalid value for '--seq-len'", "headlab memory"),
])
def test_a_parse_error_is_one_line_and_exit_2(args, said, where, capsys):
    code, out, err = run_cli(args, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and said in err, err
    assert err.rstrip().endswith(f"; see '{where} --help'"), err


def test_help_and_no_arguments_are_as_before(capsys):
    code, out, err = run_cli(["--help"], capsys)
    assert code == 0 and "Usage" in out and err == ""
    code, out, err = run_cli([], capsys)  # typer shows the help and exits 2, as it always did
    assert code == 2 and "Usage" in out


def test_an_exit_code_a_command_asks_for_is_kept(monkeypatch, capsys):
    """Without click's standalone mode, ``typer.Exit(n)`` (and Ctrl-C's 130) come back as a return value:
    ``main`` must still exit with it."""
    from headlab.cli import main as M

    monkeypatch.setattr(M, "app", lambda **kw: 130)
    with pytest.raises(SystemExit) as e:
        M.main([])
    assert e.value.code == 130
    monkeypatch.setattr(M, "app", lambda **kw: None)
    M.main([])  # a command that returns: exit 0


# -- ring_cost refuses what the ring kernel refuses --------------------------------------------------------------
@pytest.mark.parametrize("n", [8, 12, 15, 16, 24, 30])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", None])
def test_ring_cost_takes_exactly_the_lengths_the_kernel_shards(n, ranks, layout):
    from headlab.costs import AttentionShape
    from headlab.costs.ring import ring_cost
    from headlab.distributed.layout import positions

    shape = AttentionShape(heads=2, q_len=n, head_dim=8, causal=True)
    chosen = layout or ("zigzag" if n % (2 * ranks) == 0 else "contiguous")
    try:  # the kernel's own cut: ring_attention shards (and refuses) through it
        shards = [positions(n, rank=r, world_size=ranks, layout=chosen) for r in range(ranks)]
    except ShapeError:
        parts = ranks if chosen == "contiguous" else 2 * ranks
        with pytest.raises(ShapeError, match=f"pad the sequence to {-(-n // parts) * parts} positions"):
            ring_cost(shape, ranks, layout=layout)
        return
    c = ring_cost(shape, ranks, layout=layout)
    assert c.layout == chosen and all(len(s) == c.shard_len for s in shards)
    assert sorted(torch.cat(shards).tolist()) == list(range(n))  # every position on exactly one rank


def _write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path
