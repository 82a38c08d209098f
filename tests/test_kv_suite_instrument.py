"""``headlab kv suite``: the RULER-style suite as an instrument of the study runner (issue 42 on issue 39's runner).

A unit is one task under every policy; its values equal :func:`headlab.generate` and
:func:`~headlab.decode.suite_stats.decoded_nll` run by hand on the same ids, and the table is
:func:`~headlab.decode.suite_instrument.suite_rows` of them. Ctrl-C keeps the finished tasks and the printed line
resumes the rest; bad policies are refused before the load."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
import transformers

from conftest import run_cli, save_word_level

WORDS = ["<pad>", "<unk>", "the", "is", "for", "one", "of", "special", "magic", "number", "numbers", "red", "door",
         "what", ":", ".", ",", "village", "a", "and", "in", "to", "answer", "var"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=512, attn_implementation="eager")).eval()
    return save_word_level(tmp_path_factory.mktemp("tiny-suite"), model, WORDS)


OPTIONS = {"policies": "full;full:bits=4,group=8", "n": 3, "tokens": 128, "ppl": 1, "continuation": 6}


def test_a_unit_is_every_policy_on_one_task_and_the_table_pairs_them(tiny):
    import headlab
    from headlab import kv
    from headlab.decode import suite
    from headlab.decode.suite_instrument import suite_rows
    from headlab.decode.suite_stats import decoded_nll
    from headlab.interpret.study import runner

    out = runner.run("kv-suite", {"model": str(tiny), **OPTIONS})
    figures = out.result.figures
    lm = headlab.load(str(tiny))
    tok = lm.tokenizer
    tasks = suite.make_suite(tok, 3, tokens=128, seed=0, continuation_tokens=6)
    units = {}
    for i, t in enumerate(tasks):
        ids = [torch.tensor([tok(x, add_special_tokens=False)["input_ids"]]) for x in (t.context, t.question)]
        unit = {"kind": t.kind, "length": ids[0].shape[1] + ids[1].shape[1], "policies": {}}
        for text in ("full", "full:bits=4,group=8"):
            policy = None if text == "full" else kv.Policy.parse(text)
            g = headlab.generate(lm, ids[0], question=ids[1], policy=policy, max_new_tokens=t.max_new_tokens)
            row = {"right": int(t.correct(g.text)), "score": t.score(g.text), "bytes": g.kv_bytes / g.kv_bytes_full,
                   "seconds": 1.0}
            if i < 1:
                cont = torch.tensor([tok(t.continuation, add_special_tokens=False)["input_ids"]])
                row["nll"] = float(decoded_nll(lm, ids[0], cont, policy=policy, question=ids[1]).mean())
            unit["policies"][text] = row
        units[i] = unit
    expected = suite_rows(["full", "full:bits=4,group=8"], [units[i] for i in range(3)])
    assert figures["tasks"] == 3 and len(figures["rows"]) == 2
    for got, want in zip(figures["rows"], expected):
        for key in ("policy", "right", "n", "ruler_score", "kv_bytes_vs_full", "by_kind", "decoded_ppl"):
            assert got[key] == pytest.approx(want[key]), key
    assert figures["rows"][0]["kv_bytes_vs_full"] == 1.0 and figures["rows"][1]["kv_bytes_vs_full"] < 1.0  # the full-precision tail holds much of so short a context
    assert "vs_first" in figures["rows"][1] and "vs_first" not in figures["rows"][0]


def test_ctrl_c_keeps_the_finished_tasks_and_the_printed_line_resumes(tiny, tmp_path, monkeypatch, capsys):
    from headlab.decode.suite_instrument import KVSuite

    real = KVSuite.run_unit
    calls: list[int] = []

    def stopping(self, ctx, unit, recording=None):
        calls.append(unit.payload)
        if unit.payload == 2 and calls.count(2) == 1:
            raise KeyboardInterrupt
        return real(self, ctx, unit, recording)

    monkeypatch.setattr(KVSuite, "run_unit", stopping)
    argv = ["kv", "suite", "--model", str(tiny), "--policies", "full;full:bits=4,group=8", "--n", "3", "--tokens", "128",
            "--ppl", "0", "--out", str(tmp_path / "s.json")]
    code, _, err = run_cli(argv, capsys)
    assert code == 130 and "kept 2 of 3 units" in err and "--resume" in err, err
    line = err.strip().splitlines()[-1].split(": ", 2)[-1]
    assert line.startswith("headlab kv suite") and line.endswith("--resume"), line
    code, out, err = run_cli(shlex.split(line)[1:], capsys)  # pasted back as a shell reads it
    assert code == 0 and calls == [0, 1, 2, 2], (calls, err)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["tasks"] == 3 and doc["headlab"]["kind"] == "kv_suite" and len(doc["units"]) == 3 and "| full:bits=4,group=8 | " in out


@pytest.mark.parametrize("policies, words", [("full;nope:3", "unknown kv rule 'nope:3'"),
                                             ("full;full", "named twice"), (";", "at least one policy")])
def test_bad_policies_are_refused_before_the_load(policies, words, tmp_path, no_load, capsys):
    code, _, err = run_cli(["kv", "suite", "--policies", policies, "--out", str(tmp_path / "s.json")], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, words", [(["--n", "1000000"], "at most 100,000 tasks"),
                                         (["--tokens", "100000000"], "must fit in the 8,192 positions of smollm2")])
def test_sizes_past_the_model_or_reason_are_refused_before_the_load(argv, words, tmp_path, no_load, capsys):
    code, _, err = run_cli(["kv", "suite", *argv, "--out", str(tmp_path / "s.json")], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_sixteen_bit_storage_and_a_question_in_the_prompt_are_what_generate_does_with_them(tiny):
    """``--kv-dtype float16``: every cache held in 16 bits, the bytes counted against a 16-bit full cache;
    ``--query-aware``: the question ends the prompt (SnapKV's observation window sees it)."""
    import headlab
    from headlab import kv
    from headlab.decode import suite
    from headlab.interpret.study import runner

    opts = {**OPTIONS, "n": 2, "ppl": 0, "kv_dtype": "float16", "query_aware": True}
    out = runner.run("kv-suite", {"model": str(tiny), **opts})
    lm = headlab.load(str(tiny))
    tok = lm.tokenizer
    policy = kv.Policy.parse("full:bits=4,group=8")
    right = []
    for t in suite.make_suite(tok, 2, tokens=128, seed=0, continuation_tokens=6):
        prompt = torch.tensor([tok(t.context, add_special_tokens=False)["input_ids"]
                               + tok(t.question, add_special_tokens=False)["input_ids"]])
        g = headlab.generate(lm, prompt, policy=policy, max_new_tokens=t.max_new_tokens, kv_dtype=torch.float16)
        g32 = headlab.generate(lm, prompt, policy=policy, max_new_tokens=t.max_new_tokens)
        assert g.kv_bytes_full * 2 == g32.kv_bytes_full and g.kv_bytes < g32.kv_bytes  # held in 16 bits
        right.append((int(t.correct(g.text)), g.kv_bytes / g.kv_bytes_full))
    row = out.result.figures["rows"][1]
    assert row["right"] == sum(r for r, _ in right)
    assert row["kv_bytes_vs_full"] == pytest.approx(sum(b for _, b in right) / 2)


@pytest.mark.parametrize("argv, words", [(["--kv-dtype", "int8"], "--kv-dtype: unknown dtype 'int8'; use one of float16")])
def test_a_storage_dtype_the_caches_cannot_hold_is_refused_before_the_load(argv, words, tmp_path, no_load, capsys):
    code, _, err = run_cli(["kv", "suite", *argv, "--out", str(tmp_path / "s.json")], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []
