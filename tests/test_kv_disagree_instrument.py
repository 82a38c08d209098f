"""``headlab kv disagree``: the tasks two policies of finished suite runs disagreed on, decoded again under other
policies, as an instrument of the study runner.

Its counts equal :func:`headlab.generate` run by hand on the same tasks; ``--rotate-values`` leaves the model's
output unchanged (a Hadamard matrix folded into W_V and W^O); bad runs are refused in one line before the load."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from conftest import run_cli
import test_kv_suite_instrument

tiny = test_kv_suite_instrument.tiny  # the suite's tiny word-level Llama (a module-scoped fixture)

POLICIES = "full;full:bits=4,group=8"


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """A finished 4-task suite run whose 4-bit answers on tasks 1 and 3 are flipped: the two disagree there."""
    from headlab.interpret.study import runner

    path = tmp_path_factory.mktemp("runs") / "suite.json"
    runner.run("kv-suite", {"model": str(tiny), "policies": POLICIES, "n": 4, "tokens": 128, "ppl": 0,
                            "continuation": 6, "out": path})
    doc = json.loads(path.read_text())
    for i in (1, 3):
        row = doc["units"][f"task {i}"]["policies"]["full:bits=4,group=8"]
        row["right"] = 1 - doc["units"][f"task {i}"]["policies"]["full"]["right"]
    path.write_text(json.dumps(doc))
    return path, doc


def test_the_counts_are_generate_by_hand_on_the_disagreeing_tasks(tiny, run):
    import headlab
    from headlab import kv
    from headlab.decode import suite
    from headlab.interpret.study import runner

    path, doc = run
    decoded = "full;full:bits=8,group=8;full:bits=4,group=8"
    out = runner.run("kv-disagree", {"runs": str(path), "policies": decoded})
    f = out.result.figures
    lm = headlab.load(str(tiny))
    tok = lm.tokenizer
    tasks = suite.make_suite(tok, 4, tokens=128, seed=0, continuation_tokens=6)
    base = [doc["units"][f"task {i}"]["policies"]["full"]["right"] for i in (1, 3)]
    comp = [1 - b for b in base]
    assert (f["tasks"], f["baseline"], f["compared"]) == (2, "full", "full:bits=4,group=8")
    assert f["tasks_run"] == [[0, 1], [0, 3]] and (f["baseline_right"], f["compared_right"]) == (sum(base), sum(comp))
    for row, text in zip(f["rows"], decoded.split(";")):
        policy = None if text == "full" else kv.Policy.parse(text)
        right = []
        for i in (1, 3):
            t = tasks[i]
            ids = [torch.tensor([tok(x, add_special_tokens=False)["input_ids"]]) for x in (t.context, t.question)]
            g = headlab.generate(lm, ids[0], question=ids[1], policy=policy, max_new_tokens=t.max_new_tokens)
            right.append(int(t.correct(g.text)))
        recorded = [doc["units"][f"task {i}"]["policies"].get(text, {}).get("right") for i in (1, 3)]
        assert row["policy"] == text and row["right"] == sum(right)
        assert row["as_baseline"] == sum(r == b for r, b in zip(right, base))
        assert row["as_compared"] == sum(r == c for r, c in zip(right, comp))
        assert row["as_recorded"] == (None if recorded[0] is None else sum(r == x for r, x in zip(right, recorded)))
    assert f["rows"][0]["as_recorded"] == 2 and f["rows"][2]["as_recorded"] == 0  # unedited answers come back


@pytest.mark.parametrize("query_aware", [True, False])
def test_the_tasks_are_asked_as_the_runs_asked_them(tiny, run, tmp_path, monkeypatch, query_aware):
    """A ``--query-aware`` suite run's tasks are decoded again with the question ending the prompt (the selection sees
    it); otherwise the context is compressed, then the question asked; and in the runs' ``--kv-dtype``."""
    import importlib

    from headlab.decode import suite
    from headlab.interpret.study import runner

    _, doc = run
    d = json.loads(json.dumps(doc))
    d["headlab"]["settings"].update(query_aware=query_aware, kv_dtype="float16")
    (tmp_path / "qa.json").write_text(json.dumps(d))
    gen = importlib.import_module("headlab.decode.generate")  # the module (headlab.decode.generate is the function)
    calls, real = [], gen.generate

    def spy(lm, context, *, question=None, **kw):
        calls.append((context.shape[1], None if question is None else question.shape[1], kw["kv_dtype"]))
        return real(lm, context, question=question, **kw)

    monkeypatch.setattr(gen, "generate", spy)
    runner.run("kv-disagree", {"runs": str(tmp_path / "qa.json"), "policies": "full:bits=8,group=8"})
    import headlab

    tok = headlab.load(str(tiny)).tokenizer
    want = []
    for i in (1, 3):
        t = suite.make_suite(tok, 4, tokens=128, seed=0, continuation_tokens=6)[i]
        c, q = (len(tok(x, add_special_tokens=False)["input_ids"]) for x in (t.context, t.question))
        want.append((c + q, None, "float16") if query_aware else (c, q, "float16"))
    assert calls == want


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_rotated_values_leave_the_model_unchanged(family):
    from headlab.decode.disagree_instrument import rotate_values
    from headlab.models.loaded_model import resolve

    torch.manual_seed(0)
    if family == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, attention_bias=True, attn_implementation="eager")).eval()
    else:
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=50, n_embd=32, n_layer=2, n_head=4, attn_implementation="eager")).eval()
    from headlab.models import adapt

    adapter = resolve(adapt(m))[0]
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        before = m(ids).logits.clone()
    w_v = adapter.W_V(1).clone()
    rotate_values(adapter)
    with torch.no_grad():
        after = m(ids).logits
    assert (adapter.W_V(1) - w_v).abs().max() > 1e-3  # the values are stored turned
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_a_head_dim_that_is_not_a_power_of_two_is_refused():
    from headlab.decode.quant import hadamard
    from headlab.errors import ConfigError

    with pytest.raises(ConfigError, match="head dim 24 is not a power of 2: no Hadamard rotation"):
        hadamard(24)


@pytest.mark.parametrize("edit, argv, words", [
    (None, ["--runs", "/nonexistent/s.json"], "does not exist"),
    ("kind", [], "not a `headlab kv suite` result"),
    (None, ["--compared", "full"], "other than their first"),
    ("agree", [], "agree on every task; nothing to decode again"),
    ("seedless", [], "differ in a setting other than --seed"),
])
def test_bad_runs_are_refused_in_one_line_before_the_load(run, edit, argv, words, tmp_path, no_load, capsys):
    path, doc = run
    runs = str(path)
    if edit is not None:
        d = json.loads(json.dumps(doc))
        if edit == "kind":
            d["headlab"]["kind"] = "kv_step"
        elif edit == "agree":
            for u in d["units"].values():
                u["policies"]["full:bits=4,group=8"]["right"] = u["policies"]["full"]["right"]
        else:
            d["headlab"]["settings"]["tokens"] = 256
        (tmp_path / "other.json").write_text(json.dumps(d))
        runs = str(tmp_path / "other.json") if edit != "seedless" else f"{path},{tmp_path / 'other.json'}"
    code, _, err = run_cli(["kv", "disagree", "--runs", runs, "--policies", "full:bits=8", *argv,
                            "--out", str(tmp_path / "out.json")], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.json").exists()


def test_the_command_prints_the_counts_and_writes_them(run, tmp_path, capsys):
    path, _ = run
    code, out, err = run_cli(["kv", "disagree", "--runs", str(path), "--policies", "full:bits=4,group=8",
                              "-o", str(tmp_path / "d.json")], capsys)
    doc = json.loads((tmp_path / "d.json").read_text())
    assert code == 0 and doc["headlab"]["kind"] == "kv_disagree" and doc["tasks"] == 2, err
    assert "2 tasks on which 'full' and 'full:bits=4,group=8' disagree" in out and "| full:bits=4,group=8 | " in out
