"""A second census of bad and odd inputs (issue 31: "at least 150 bad inputs of your own across every command"),
none of them already in ``test_bad_inputs.py``.

Every row names the class the input ended in before the census's fixes, as the issue counts them: ``clean``
(refused with a typed error, one line), ``valid`` (odd but fine, and the answer is right), ``traceback``,
``untyped`` (an exception that is no :class:`~headlab.errors.HeadlabError`), ``silently wrong`` (exit 0 or a
result, but not what was asked), ``hang`` and ``bug`` (refused, but late, in two lines or with a wrong message).
A row still failing in a file this census could not change is ``xfail(strict=True)`` with the fix in its reason,
so it turns into a failure the day it is fixed, and the mark comes off.

The command-line rows run in-process (:func:`conftest.run_cli`): exit 2, one line on stderr that matches, and,
for :data:`REFUSED`, no model loaded (the ``no_load`` fixture makes a load fail the test). :data:`LOAD_REFUSES`
are model paths that only the load can judge (it refuses them before reading any weight). :data:`VALID` rows
check the printed figures against a computation of their own.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import pytest
import torch

import headlab
from headlab import costs
from headlab.errors import (ConfigError, DTypeError, HeadlabError, InputError, MaskError, ModelError, ShapeError,
                            SiteError, UnknownBackendError)
from conftest import run_cli

CLASSES = {"clean", "valid", "traceback", "untyped", "silently wrong", "hang", "bug"}
PAIR = ["--clean", "a b", "--corrupted", "a c", "--answer", " x", "--wrong", " y"]  # patch's four texts
M, D, O = ["--model", "minilm"], ["--data", "{data}"], ["--out", "{tmp}/o"]
CONLLU = ("# text = the cat sat\n1\tthe\tthe\tDET\tDT\t_\t2\tdet\t_\t_\n2\tcat\tcat\tNOUN\tNN\t_\t3\tnsubj\t_\t_\n"
          "3\tsat\tsit\tVERB\tVBD\t_\t0\troot\t_\t_\n\n")


def xf(reason: str):
    return pytest.mark.xfail(strict=True, reason=reason)


def case(args, before, match, fix=None):
    """One row: the command line, its class before the census's fixes, what stderr must say; ``fix``: still open
    in a file of another helper (xfail, strict), with the exact fix."""
    assert before in CLASSES
    return pytest.param(args, before, match, id=" ".join(args)[:70], marks=[xf(fix)] if fix else [])


def _files(tmp: Path) -> dict:
    """The placeholders of the tables: files a new user might hand a command by mistake."""
    (tmp / "file").write_text("x")
    (tmp / "latin1.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    (tmp / "empty.txt").write_text("")
    for d in ("adir", "busy", "notmodel", "badcfg"):
        (tmp / d).mkdir()
    (tmp / "busy" / "x").write_text("x")
    (tmp / "bad.conllu").write_text("1\t2\n")
    (tmp / "good.conllu").write_text(CONLLU)
    (tmp / "data.tsv").write_text("sentence\tlabel\nthe cat sat\t1\na dog\t0\n")
    (tmp / "nocol.tsv").write_text("label\tfoo\n1\tthe cat\n")
    (tmp / "list.json").write_text("[1, 2, 3]\n")  # JSON, but not an object
    (tmp / "other.json").write_text(json.dumps({"headlab": {"kind": "rollout", "version": "0", "model": "m",
                                                            "settings": {}}, "n": 3}))  # a result of another kind
    (tmp / "notjson.json").write_text("{not json")
    (tmp / "exists.json").write_text("{}")
    (tmp / "notmodel" / "config.json").write_text('{"model_type": "bogus-type"}')
    (tmp / "badcfg" / "config.json").write_text("{not json")
    names = {"file": "file", "latin1": "latin1.txt", "empty": "empty.txt", "dir": "adir", "busy": "busy",
             "conllu": "bad.conllu", "good": "good.conllu", "data": "data.tsv", "nocol": "nocol.tsv",
             "list": "list.json", "other": "other.json", "notjson": "notjson.json", "exists": "exists.json",
             "notmodel": "notmodel", "badcfg": "badcfg"}
    return {"tmp": tmp, **{k: tmp / v for k, v in names.items()}}


def _run(args, tmp_path, capsys):
    files = _files(tmp_path)
    argv = [a.format(**files) for a in args]
    return run_cli(argv, capsys)


def _one_line(code, out, err, match):
    assert code == 2, (code, out, err)
    assert err.count("\n") == 1 and err.startswith("error:"), err
    assert "Traceback" not in err and re.search(match, err), err


REFUSED = [
    # memory (the cost model's command): counts, names, files, conflicting and non-finite figures
    case(["memory", "--seq-len", "-5"], "clean", r"q_len must be a positive integer, got -5"),
    case(["memory", "--heads", "0"], "clean", r"heads must be a positive integer, got 0"),
    case(["memory", "--heads", "-1"], "clean", r"heads must be a positive integer, got -1"),
    case(["memory", "--layers", "0"], "clean", r"layers must be a positive integer, got 0"),
    case(["memory", "--batch", "0"], "clean", r"batch must be a positive integer"),
    case(["memory", "--head-dim", "0"], "clean", r"head_dim must be a positive integer"),
    case(["memory", "--kv-heads", "0"], "clean", r"kv_heads must be a positive integer"),
    case(["memory", "--kv-heads", "64"], "clean", r"heads=32 must be a multiple of kv_heads=64"),
    case(["memory", "--kv-len", "0"], "clean", r"kv_len must be a positive integer"),
    case(["memory", "--dtype", ""], "clean", r"unknown dtype ''"),
    case(["memory", "--pattern", "bogus"], "clean", r"unknown mask pattern 'bogus'"),
    case(["memory", "--pattern", ""], "clean", r"a mask spec must be a non-empty string"),
    case(["memory", "--pattern", "sliding_window:0"], "clean", r"window must be a positive integer, got 0"),
    case(["memory", "--link-bandwidth", "inf", "--peak-flops", "1e12"], "silently wrong",
         r"--link-bandwidth must be a positive number, got inf"),
    case(["memory", "--link-bandwidth", "1e9", "--peak-flops", "-1"], "clean", r"--peak-flops must be a positive"),
    case(["memory", "--link-bandwidth", "1e9", "--peak-flops", "nan"], "clean", r"--peak-flops .* got nan"),
    case(["memory", "--ranks", "-2"], "clean", r"--ranks must be at least 1, got -2"),
    case(["memory", "--ranks", "2", "--ring", "--seq-len", "7"], "clean", r"--seq-len 7 does not split into 2"),
    case(["memory", "--kv-policy", ""], "bug", r"--kv-policy is empty"),  # was: "--kv-policy '.' is a folder"
    case(["memory", "--kv-policy", "streaming:-1,4"], "clean", r"sink=-1 is negative"),
    case(["memory", "--kv-policy", "streaming:4"], "clean", r"write streaming:SINK,RECENT with two integers"),
    case(["memory", "--kv-policy", "snapkv:0"], "clean", r"budget=0 must be at least 1"),
    case(["memory", "--kv-policy", "{file}/x.json"], "clean", r"--kv-policy .*x.json' does not exist"),
    case(["memory", "--kv-policy", "{list}"], "clean", r"policy file .*list.json': expected \{\"default\""),
    case(["memory", "--kv-policy", "{other}"], "clean", r"policy file .*other.json': expected"),
    case(["memory", "--kv-policy", "{exists}"], "clean", r"policy file .*exists.json': expected"),
    case(["memory", "--kv-policy", "{notjson}"], "clean", r"notjson.json' is not JSON"),
    case(["memory", "--seq-len", "abc"], "clean", r"Invalid value for '--seq-len'"),
    case(["memory", "--heads", "1e3"], "clean", r"Invalid value for '--heads'"),
    case(["memory", "--bogus"], "clean", r"No such option: --bogus; see 'headlab memory --help'"),
    # backends, models, top level
    case(["backends", "--bogus"], "clean", r"No such option: --bogus"),
    case(["backends", "extra"], "clean", r"unexpected extra argument"),
    case(["models", "--json", "--check"], "clean", r"Option '--check' requires an argument"),
    case(["bogus"], "clean", r"No such command 'bogus'"),
    case(["--bogus"], "clean", r"No such option: --bogus"),
    case(["heads", "bogus"], "clean", r"No such command 'bogus'; see 'headlab heads --help'"),
    case(["bench", "bogus"], "clean", r"No such command 'bogus'; see 'headlab bench --help'"),
    case(["demo", "extra"], "clean", r"unexpected extra argument"),
    # bench attention
    case(["bench", "attention", "--seq-lens", "16", "--heads", "0"], "clean", r"heads must be an integer >= 1"),
    case(["bench", "attention", "--seq-lens", "16", "--heads", "-4"], "clean", r"heads must be an integer >= 1"),
    case(["bench", "attention", "--seq-lens", "16", "--head-dim", "0"], "clean", r"head_dim must be an integer"),
    case(["bench", "attention", "--seq-lens", "16", "--batch", "0"], "clean", r"batch must be an integer >= 1"),
    case(["bench", "attention", "--seq-lens", "16", "--dtype", "int8"], "clean", r"unknown dtype 'int8'"),
    case(["bench", "attention", "--seq-lens", "16", "--dtype", "bogus"], "clean", r"unknown dtype 'bogus'"),
    case(["bench", "attention", "--seq-lens", "-16"], "clean", r"--seq-lens must be positive integers"),
    case(["bench", "attention", "--seq-lens", "0"], "clean", r"--seq-lens must be positive integers"),
    case(["bench", "attention", "--seq-lens", "16,abc"], "clean", r"--seq-lens must be comma-separated integers"),
    case(["bench", "attention", "--seq-lens", "nan"], "clean", r"--seq-lens must be comma-separated integers"),
    case(["bench", "attention", "--seq-lens", "16", "--backends", ","], "clean", r"--backends is empty"),
    case(["bench", "attention", "--seq-lens", "16", "--backends", "sdpa,bogus"], "clean", r"unknown backend 'bogus'"),
    case(["bench", "attention", "--seq-lens", "16", "--pattern", "bogus"], "clean", r"unknown mask pattern"),
    case(["bench", "attention", "--seq-lens", "16", "--pattern", "sliding_window:-1"], "clean", r"got -1"),
    case(["bench", "attention", "--seq-lens", "16", "--repeats", "-3"], "clean", r"repeats must be an integer >= 1"),
    case(["bench", "attention", "--seq-lens", "16", "--repeats", "1000000000000000000000"], "hang",
         r"repeats must be at most 10,000"),
    case(["bench", "attention", "--seq-lens", "16", "--feature-map", "favor:0"], "clean", r"num_features=0"),
    case(["bench", "attention", "--seq-lens", "16", "--feature-map", ""], "clean", r"cannot read feature map ''"),
    case(["bench", "attention", "--seq-lens", "16", "--json", "{exists}"], "clean", r"exists.json' exists.*--force"),
    # pattern
    case(["pattern", "causal", "--seq-len", "0"], "clean", r"--seq-len must be in 1..8192"),
    case(["pattern", "causal", "--seq-len", "-3"], "clean", r"--seq-len must be in 1..8192"),
    case(["pattern", "sliding_window", "--window", "0"], "clean", r"window must be a positive integer, got 0"),
    case(["pattern", "sliding_window", "--window", "-2"], "clean", r"window must be a positive integer, got -2"),
    case(["pattern", "dilated_window", "--window", "2", "--dilation", "0"], "clean", r"dilation must be a positive"),
    case(["pattern", "strided", "--stride", "0"], "clean", r"stride must be a positive integer"),
    case(["pattern", "strided"], "clean", r"pattern 'strided' needs --stride"),
    case(["pattern", "fixed", "--stride", "4", "--summary", "0"], "clean", r"summary must be a positive integer"),
    case(["pattern", "fixed", "--stride", "4", "--summary", "9"], "clean", r"summary=9 must be <= stride=4"),
    case(["pattern", "bigbird", "--block", "0"], "clean", r"block must be a positive integer"),
    case(["pattern", "bigbird", "--block", "4", "--random", "-1"], "clean", r"random_blocks must be >= 0"),
    case(["pattern", "global_tokens", "--global", "99"], "clean", r"every index is outside the sequence"),
    case(["pattern", "global_tokens", "--global", "-1"], "clean", r"indices must be >= 0"),
    case(["pattern", "global_tokens", "--global", "a,b"], "clean", r"--global must be comma-separated integers"),
    case(["pattern", "documents", "--lengths", ""], "clean", r"cannot read '' in mask spec"),
    case(["pattern", "documents", "--lengths", "0,32"], "clean", r"document lengths must be >= 1"),
    case(["pattern", "documents", "--lengths", "-1,33"], "clean", r"document lengths must be >= 1"),
    case(["pattern", "causal", "--tile", "0"], "clean", r"tile must be positive"),
    case(["pattern", "causal", "--head", "-1"], "clean", r"--head must be in 0..0"),
    case(["pattern", ""], "clean", r"unknown mask pattern ''"),
    case(["pattern", "causal", "--width", "-5"], "clean", r"--width must be at least 1"),
    case(["pattern", "causal", "--json", "--png", "/proc/x.png"], "clean", r"--png '/proc/x.png' cannot be written"),
    case(["pattern", "causal", "--png", "{tmp}/p.txt"], "traceback", r"--png .*p.txt.*\.png"),
    case(["pattern", "causal", "--window", "3"], "silently wrong", r"--window.*acts only"),
    # analyze
    case(["analyze", "", *O], "clean", r"the text is empty"),
    case(["analyze", "the cat", "--heads", "", *O], "clean", r"no heads given"),
    case(["analyze", "the cat", "--heads", "a.b", *O], "clean", r"cannot read head 'a.b'"),
    case(["analyze", "the cat", "--heads", "0.-1", *O], "clean", r"head 0.-1 does not exist"),
    case(["analyze", "the cat", "--heads", "-1.0", *O], "clean", r"head -1.0 does not exist"),
    case(["analyze", "the cat", "--max-full-tokens", "-5", *O], "clean", r"max_full_tokens must be at least 1"),
    case(["analyze", "the cat", "--probe", "{tmp}/none.json", *O], "clean", r"--probe .*none.json: no such file"),
    case(["analyze", "the cat", "--probe", "{dir}", *O], "clean", r"--probe .*adir"),
    case(["analyze", "the cat", "--heads-result", "{notjson}", *O], "clean", r"is not a headlab heads result"),
    case(["analyze", "the cat", "--heads-result", "{list}", *O], "clean", r"is not a headlab heads result"),
    case(["analyze", "the cat", "--heads-result", "{dir}", *O], "clean", r"adir: no such file"),
    case(["analyze", "the cat", "--backend", "", *O], "clean", r"unknown backend ''"),
    case(["analyze", "the cat", "--out", "{file}"], "clean", r"is a file; give a folder"),
    case(["analyze", "the cat", "--probe", "{list}", *O], "traceback", r"--probe .*list.json is not a headlab probe"),
    case(["analyze", "the cat", "--heads-result", "{other}", *O], "silently wrong", r"--heads.*rollout"),
    # atlas
    case(["atlas", *O, "--kinds", "bogus"], "clean", r"--kinds: unknown 'bogus'"),
    case(["atlas", *O, "--kinds", "induction,bogus"], "clean", r"--kinds: unknown 'bogus'"),
    case(["atlas", *O, "--draws", "-1"], "clean", r"--draws must be at least 1, got -1"),
    case(["atlas", *O, "--top-k", "-3"], "clean", r"--top-k must be at least 1, got -3"),
    case(["atlas", *O, "--n-texts", "-1"], "clean", r"--n-texts must be at least 1"),
    case(["atlas", *O, "--needles", "-2"], "clean", r"--needles must be at least 1"),
    case(["atlas", *O, "--max-tokens", "-1"], "clean", r"--max-tokens must be at least 8"),
    case(["atlas", *O, "--half", "0"], "clean", r"--half must be at least 2, got 0"),
    case(["atlas", *O, "--haystack", "0"], "clean", r"--haystack must be at least 8, got 0"),
    case(["atlas", *O, "--seed", "abc"], "clean", r"Invalid value for '--seed'"),
    case(["atlas", *O, "--texts", "{file}/sub"], "clean", r"--texts .*sub' does not exist"),
    case(["atlas", *O, "--texts", "{empty}"], "clean", r"--texts .*empty.txt' is empty"),
    case(["atlas", *O, "--treebank", "{latin1}"], "clean", r"--treebank: .*not UTF-8 text: byte 0xe9"),
    case(["atlas", *O, "--treebank", "{tmp}/none.conllu"], "clean", r"--treebank .*none.conllu' does not exist"),
    case(["atlas", *O, "--kinds", "syntactic", "--treebank", "{empty}"], "clean", r"holds no sentence"),
    case(["atlas"], "clean", r"Missing option '--out'"),
    # patch
    case(["patch", *PAIR, "--top", "-1"], "clean", r"--top must be at least 1, got -1"),
    case(["patch", *PAIR, "--method", "bogus"], "clean", r"--method 'bogus': choose one of exact"),
    case(["patch", *PAIR, "--sites", "bogus"], "clean", r"--sites 'bogus': choose from the kinds"),
    case(["patch", *PAIR, "--sites", "z,bogus"], "clean", r"--sites 'z,bogus'"),
    case(["patch", *PAIR, "--method", "attribution", "--sites", "resid_pre"], "clean", r"head sites only"),
    case(["patch", *PAIR, "--positions", "a,b"], "clean", r"--positions takes 'each' or comma-separated"),
    case(["patch", *PAIR, "--positions", "1.5"], "clean", r"--positions takes 'each'"),
    case(["patch", *PAIR, "--positions", "each,3"], "clean", r"--positions takes 'each'"),
    case(["patch", "--clean", "", *PAIR[2:]], "clean", r"--clean is empty"),
    case(["patch", *PAIR[:2], "--corrupted", " ", *PAIR[4:]], "clean", r"--corrupted is empty"),
    case(["patch", *PAIR[:6], "--wrong", ""], "clean", r"--wrong is empty"),
    case(["patch", *PAIR, "--out", "{dir}"], "clean", r"give a file ending in .json"),
    case(["patch", *PAIR, "--out", "{exists}"], "clean", r"exists.json' exists.*--force"),
    case(["patch", *PAIR[:6]], "clean", r"Missing option '--wrong'"),
    # explain
    case(["explain", "the cat", *M, "--methods", "bogus"], "clean", r"unknown method 'bogus'"),
    case(["explain", "the cat", *M, "--methods", "attention,bogus"], "clean", r"unknown method 'bogus'"),
    case(["explain", "the cat", *M, "--ig-steps", "-1"], "clean", r"ig_steps must be a positive integer"),
    case(["explain", "the cat", *M, "--backend", "bogus"], "clean", r"unknown backend 'bogus'"),
    case(["explain", "the cat", *M, "--loo", ""], "clean", r"unknown loo mode ''"),
    case(["explain", "the cat", *M, "--target", "abc"], "clean", r"Invalid value for '--target'"),
    case(["explain", *M], "clean", r"no text: give TEXT to explain, or --dataset"),
    case(["explain", "the cat"], "clean", r"Missing option '--model'"),
    case(["explain", *M, "--dataset", "{dir}", *O], "clean", r"adir' is a folder"),
    case(["explain", *M, "--dataset", "{tmp}/none.tsv", *O], "clean", r"no dataset file .*none.tsv"),
    case(["explain", *M, "--dataset", "{nocol}", *O], "clean", r"no column sentence \(or text\)"),
    case(["explain", "the cat", *M, "--out", "/proc/headlab-x"], "clean", r"cannot be written"),
    case(["explain", "the cat", *M, "--out", "{file}/sub"], "clean", r"so no folder can be made under it"),
    case(["explain", *M, "--dataset", "{data}", *O, "--max-minutes", "nan"], "clean", r"--max-minutes .* got nan"),
    case(["explain", "the cat", *M, "--ig-steps", "1000000"], "untyped", r"--ig-steps must be at most 10,000 .*got 1,000,000"),
    # flow
    case(["flow", "the cat", "--method", "bogus"], "clean", r"unknown --method 'bogus'"),
    case(["flow", "the cat", "--method", ""], "clean", r"unknown --method ''"),
    case(["flow", "the cat", "--rows", "a"], "clean", r"--rows takes token positions or names"),
    case(["flow", "the cat", "--rows", "1.5"], "clean", r"--rows takes token positions"),
    case(["flow", "the cat", "--top", "abc"], "clean", r"Invalid value for '--top'"),
    case(["flow", "the cat", "--layer", "abc"], "clean", r"Invalid value for '--layer'"),
    case(["flow", "the cat", "--tensor-size", "2"], "clean", r"--tensor-size acts only with --tensor-parallel"),
    case(["flow", "the cat", "--mode", "attention"], "clean", r"--mode acts only with --method norms"),
    case(["flow", "the cat", "--method", "norm-rollout", "--solver", "scipy"], "clean", r"--solver acts only"),
    case(["flow"], "clean", r"Missing argument 'text'"),
    # probe
    case(["probe"], "clean", r"Missing option '--treebank'"),
    case(["probe", "--treebank", "{conllu}", "--limit", "-1"], "clean", r"limit must be at least 1 sentence"),
    case(["probe", "--treebank", "{good}", "--limit", "abc"], "clean", r"Invalid value for '--limit'"),
    case(["probe", "--treebank", "{empty}"], "clean", r"holds no sentence"),
    case(["probe", "--treebank", "{file}/sub"], "clean", r"sub' does not exist"),
    case(["probe", "--treebank", "{notjson}"], "clean", r"notjson.json:1: not CoNLL-U"),
    case(["probe", "--treebank", "{good}", "--relations", ","], "clean", r"no relation given"),
    case(["probe", "--treebank", "{good}", "--relations", "bogus"], "clean", r"relation 'bogus' does not occur"),
    case(["probe", "--treebank", "{good}", "--out", "{file}"], "clean", r"is a file; give a folder"),
    case(["probe", "--treebank", "{good}", "--out", "{busy}"], "clean", r"busy' exists and is not empty"),
    case(["probe", "--treebank", "{good}", "--tensor-size", "2"], "clean", r"--tensor-size acts only"),
    case(["probe", "--treebank", "{good}", "--loss-model", "{tmp}/none"], "bug", r"--loss-model .*none"),
    # heads importance / ablate / prune
    case(["heads", "importance", *M, *D, "--loss", ""], "clean", r"--loss '' is not a loss"),
    case(["heads", "importance", *M, *D, "--batch-size", "-1"], "clean", r"--batch-size must be at least 1"),
    case(["heads", "importance", *M, *D, "--limit", "-5"], "clean", r"--limit must be at least 1 example"),
    case(["heads", "importance", *M, *D, "--out", "{file}"], "clean", r"is a file; give a folder"),
    case(["heads", "importance", *M, "--data", "{file}/sub"], "clean", r"sub' does not exist"),
    case(["heads", "importance", *M, "--data", "/dev/null"], "clean", r"'/dev/null' is not a regular file"),
    case(["heads", "importance", *M, "--data", "{nocol}", "--limit", "1"], "clean", r"no 'sentence' or 'text'"),
    case(["heads", "importance", *M, *D, "--tensor-size", "2"], "clean", r"--tensor-size acts only"),
    case(["heads", "importance", "--data", "{data}"], "clean", r"Missing option '--model'"),
    case(["heads", "ablate", *M, *D, "--boot", "-1"], "clean", r"at least 2, got -1"),
    case(["heads", "ablate", *M, *D, "--boot", "1"], "clean", r"at least 2, got 1"),
    case(["heads", "ablate", *M, *D, "--kind", ""], "clean", r"--kind '' is not an ablation kind"),
    case(["heads", "ablate", *M, *D, "--k", "abc"], "clean", r"Invalid value for '--k'"),
    case(["heads", "ablate", *M, *D, "--loss", "bogus"], "clean", r"--loss 'bogus' is not a loss"),
    case(["heads", "ablate", *M, *D, "--batch-size", "0"], "clean", r"--batch-size must be at least 1"),
    case(["heads", "ablate", *M, *D, "--out", "/proc/headlab-x"], "clean", r"cannot be written"),
    case(["heads", "ablate", *M, "--data", "{empty}"], "clean", r"empty.txt' is empty"),
    case(["heads", "ablate", *M, "--data", "{latin1}"], "clean", r"not UTF-8 text: byte 0xe9"),
    case(["heads", "ablate", *M], "clean", r"--data FILE is required"),
    case(["heads", "prune", *M, *O], "clean", r"give exactly one of --heads"),
    case(["heads", "prune", *M, "--fraction", "0", *D, *O], "clean", r"--fraction must lie in \(0, 1\), got 0"),
    case(["heads", "prune", *M, "--fraction", "1", *D, *O], "clean", r"--fraction must lie in \(0, 1\), got 1"),
    case(["heads", "prune", *M, "--fraction", "-0.5", *D, *O], "clean", r"got -0.5"),
    case(["heads", "prune", *M, "--fraction", "0.5", *O], "clean", r"--data FILE is required"),
    case(["heads", "prune", *M, "--heads", "", *O], "clean", r"--heads is empty"),
    case(["heads", "prune", *M, "--heads", "0", *O], "clean", r"--heads expects LAYER.HEAD"),
    case(["heads", "prune", *M, "--heads", "0.1.2", *O], "clean", r"--heads expects LAYER.HEAD"),
    case(["heads", "prune", *M, "--heads", "x.y", *O], "clean", r"--heads expects LAYER.HEAD"),
    case(["heads", "prune", *M, "--heads", "-1.0", *O], "clean", r"head -1.0 does not exist"),
    case(["heads", "prune", *M, "--heads", "0.1", "--curve", *O], "clean", r"--data FILE is required"),
    case(["heads", "prune", *M, "--heads", "0.1", "--out", "{file}"], "clean", r"is a file; give a folder"),
    case(["heads", "prune", *M, "--heads", "0.1", "--gqa", "", *O], "clean", r"--gqa '' is not a choice"),
    case(["heads", "prune", *M, "--heads", "0.1", "--limit", "0", *O], "clean", r"--limit must be at least 1"),
    case(["heads", "prune", *M, "--heads", "0.1", "--data", "{latin1}", *O], "clean", r"not UTF-8 text"),
    case(["heads", "prune", *M, "--heads", "0.1", "--recompute", *O], "silently wrong", r"--recompute acts only"),
    # generate
    case(["generate", "hi", "-n", "0"], "clean", r"--max-new-tokens must be at least 1, got 0"),
    case(["generate", "hi", "--max-new-tokens", "abc"], "clean", r"Invalid value for '--max-new-tokens'"),
    case(["generate", "hi", "--keep", "-0.5"], "clean", r"--keep -0.5: give the fraction"),
    case(["generate", "hi", "--keep", "1.5"], "clean", r"--keep 1.5"),
    case(["generate", "hi", "--kv-from", "{dir}", "--keep", "nan"], "clean", r"--keep nan"),
    case(["generate", "hi", "--policy", "bogus"], "clean", r"unknown kv rule 'bogus'"),
    case(["generate", "hi", "--policy", ""], "clean", r"unknown kv rule ''"),
    case(["generate", "hi", "--policy", "full,bits=3"], "clean", r"unknown kv rule 'full,bits=3'"),
    case(["generate", "hi", "--policy", "streaming:-1,4"], "clean", r"sink=-1 is negative"),
    case(["generate", "hi", "--policy", "streaming:4,abc"], "clean", r"two integers"),
    case(["generate", "hi", "--policy", "snapkv:0"], "clean", r"budget=0 must be at least 1"),
    case(["generate", "hi", "--kv-from", "{tmp}/none.json"], "clean", r"none.json' is not a file"),
    case(["generate", "hi", "--kv-from", "{empty}"], "clean", r"is not readable JSON: empty"),
    case(["generate", "hi", "--kv-from", "{notjson}"], "clean", r"is not readable JSON"),
    case(["generate", "hi", "--kv-from", "{list}"], "clean", r"expected a policy"),
    case(["generate", "hi", "--kv-from", "{other}"], "clean", r"expected a policy"),
    case(["generate", "hi", "--sample", "--temperature", "-1"], "clean", r"--temperature must be a number > 0"),
    case(["generate", "hi", "--sample", "--temperature", "nan"], "clean", r"got nan"),
    case(["generate", "hi", "--sample", "--top-k", "1.5"], "clean", r"Invalid value for '--top-k'"),
    case(["generate", ""], "clean", r"the prompt is empty"),
    case(["generate", "hi", "--keep", "0.3"], "silently wrong", r"--keep.*acts only with --kv-from"),
    # train-gates
    case(["train-gates", "--out", "{tmp}/g.json", "--window", "bogus"], "clean", r"--window 'bogus'"),
    case(["train-gates", "--out", "{tmp}/g.json", "--window", "4"], "clean", r"write SINK,RECENT"),
    case(["train-gates", "--out", "{tmp}/g.json", "--window", "-1,4"], "clean", r"--window '-1,4'"),
    case(["train-gates", "--out", "{tmp}/g.json", "--steps", "0"], "clean", r"--steps must be at least 1"),
    case(["train-gates", "--out", "{tmp}/g.json", "--steps", "-1"], "clean", r"--steps must be at least 1"),
    case(["train-gates", "--out", "{tmp}/g.json", "--seconds", "0"], "clean", r"--seconds must be at least 1"),
    case(["train-gates", "--out", "{tmp}/g.json", "--seconds", "nan"], "clean", r"--seconds .* got nan"),
    case(["train-gates", "--out", "{tmp}/g.json", "--tokens", "0"], "clean", r"--tokens must be at least 324"),
    case(["train-gates", "--out", "{tmp}/g.json", "--tokens", "100000000"], "clean", r"at most 8,192 positions"),
    case(["train-gates", "--out", "{tmp}/g.json", "--contexts", "0"], "clean", r"--contexts must be at least 1"),
    case(["train-gates", "--out", "{tmp}/g.json", "--keys", "0"], "clean", r"--keys must be at least 1"),
    case(["train-gates", "--out", "{tmp}/g.json", "--lr", "0"], "clean", r"--lr must be at least"),
    case(["train-gates", "--out", "{tmp}/g.json", "--lr", "nan"], "clean", r"--lr .* got nan"),
    case(["train-gates", "--out", "{tmp}/g.json", "--l1", "-1"], "clean", r"--l1 must be at least 0"),
    case(["train-gates", "--out", "/proc/headlab-x.json"], "clean", r"cannot be written"),
    case(["train-gates", "--out", "{file}/sub.json"], "clean", r"is a file, not a folder"),
    case(["train-gates", "--out", "{dir}"], "clean", r"adir' is a folder"),
    case(["train-gates", "--out", "{exists}"], "clean", r"exists.json' exists.*--force"),
    case(["train-gates", "--out", "{tmp}/g.json", "--checkpoint", "{dir}"], "clean", r"--checkpoint .* not a file"),
    case(["train-gates"], "clean", r"Missing option '--out'"),
    case(["train-gates", "--out", "{tmp}/g.json", "--seed", "-1"], "bug", r"--seed must be at least 0"),
    case(["train-gates", "--out", "{tmp}/g.json", "--checkpoint", "{latin1}"], "traceback",
         r"--checkpoint .*latin1.txt.* is not a train-gates checkpoint"),
    # train-classifier
    case(["train-classifier", "--train", "{data}", "--validation", "{data}", "--subset", "abc"], "clean", r"subset"),
    case(["train-classifier", "--train", "{data}", "--validation", "{data}", "--seed", "-1"], "clean", r"--seed must"),
    case(["train-classifier", "--train", "{data}", "--validation", "{data}", "--epochs", "inf"], "clean", r"got inf"),
    case(["train-classifier", "--train", "{data}", "--validation", "{data}", "--epochs", "-1"], "clean", r"got -1"),
    case(["train-classifier", "--train", "{data}", "--validation", "{data}", "--threads", "-1"], "clean", r"--threads"),
    case(["train-classifier", "--train", "{data}", "--validation", "{data}", "--limit", "-3"], "clean", r"--limit"),
    case(["train-classifier", "--train", "{data}", "--validation", "{data}", "--out", "{file}"], "clean", r"is a file"),
    case(["train-classifier", "--data", "{file}"], "clean", r"file/train.tsv' does not exist"),
    case(["train-classifier", "--data", "{tmp}/none"], "clean", r"none/train.tsv' does not exist"),
    case(["train-classifier", "--train", "{data}"], "clean", r"no data: give --data FOLDER"),
    case(["train-classifier", "--train", "{tmp}/none.tsv", "--validation", "{data}"], "clean", r"does not exist"),
    case(["train-classifier", "--train", "{nocol}", "--validation", "{data}"], "bug",
         r"--train .*nocol.tsv': no column sentence"),  # was: a "fine-tuning ..." line first, then the error
    case(["train-classifier", "--train", "{data}", "--validation", "{nocol}"], "bug",
         r"--validation .*nocol.tsv': no column sentence"),
]


@pytest.mark.parametrize("args,before,match", REFUSED)
def test_cli_refuses_before_loading(args, before, match, tmp_path, capsys, no_load):
    _one_line(*_run(args, tmp_path, capsys), match)
    assert not (tmp_path / "o").exists() and not (tmp_path / "g.json").exists()  # nothing made either


LOAD_REFUSES = [
    # a model path only the load can judge: refused before any weight is read, in one line
    case(["models", "--check", "{tmp}/none"], "clean", r"unknown model '.*none': not a known name and no such folder"),
    case(["models", "--check", "{dir}"], "clean", r"adir is not a Hugging Face model folder \(no config.json\)"),
    case(["models", "--check", "{file}"], "clean", r"file' is a file; give a model folder"),
    case(["models", "--check", "{latin1}"], "clean", r"latin1.txt' is a file; give a model folder"),
    case(["models", "--check", ""], "clean", r"the model name is empty"),
    case(["models", "--check", "bogusname"], "clean", r"unknown model 'bogusname'"),
    case(["models", "--check", "{notmodel}"], "bug", r"config.json is not a Hugging Face config"),  # was: 3 lines
    case(["models", "--check", "{badcfg}"], "clean", r"config.json is not a Hugging Face config"),
    case(["flow", "the cat", "--model", "{tmp}/none"], "clean", r"unknown model"),
    case(["explain", "the cat", "--model", "{tmp}/none"], "clean", r"unknown model"),
    case(["patch", *PAIR, "--model", "{tmp}/none"], "clean", r"unknown model"),
    case(["generate", "hi", "--model", "{dir}"], "clean", r"is not a Hugging Face model folder"),
    case(["train-gates", "--out", "{tmp}/g.json", "--model", "{tmp}/none"], "clean", r"unknown model"),
    case(["demo", "--model", "{tmp}/none", "--out", "{tmp}/o"], "bug", r"unknown model"),
]


@pytest.mark.parametrize("args,before,match", LOAD_REFUSES)
def test_cli_model_paths_are_refused_by_the_load(args, before, match, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _one_line(*_run(args, tmp_path, capsys), match)


def _visible(n, ok):
    return sum(ok(i, j) for i in range(n) for j in range(n))


def _memory_small(d):
    """batch 1, 2 heads, 3 x 3, head dim 4, float32: the reference holds the map, SDPA never does."""
    return d["reference"]["attention_weights_bytes"] == 2 * 3 * 3 * 4 and d["sdpa"]["attention_weights_bytes"] == 0


def _memory_causal(d):
    """causal 4 x 6 (top-left), head dim 2: the reference multiplies every pair, SDPA only the visible ones."""
    pairs = sum(1 for i in range(4) for j in range(6) if j <= i)
    return d["reference"]["forward_flops"] == 2 * 2 * 4 * 6 * 2 and d["sdpa"]["forward_flops"] == 2 * 2 * pairs * 2


def _memory_ring(d):
    """8 positions on 4 ranks: shards of 2; each rank passes its K and V shard (2 heads x 2 x 4, float16) 3 times."""
    return d["ring"]["shard_len"] == 2 and d["ring"]["sent_forward_bytes"] == 3 * 2 * (2 * 2 * 4) * 2


def _memory_huge(d):
    """a length past any machine is still a prediction, in exact integers."""
    n = 10 ** 20
    return d["reference"]["attention_weights_bytes"] == 32 * n * n * 2


def _density(n, ok):
    return lambda d: d["visible_pairs"] == _visible(n, ok) and math.isclose(d["pair_density"], _visible(n, ok) / n ** 2)


def _backends(rows):
    from headlab.attention.backends.base import names

    return sorted(r["name"] for r in rows) == sorted(names())


VALID = [
    (["memory", "--seq-len", "3", "--heads", "2", "--dtype", "float32", "--head-dim", "4", "--json"], _memory_small),
    (["memory", "-n", "4", "--kv-len", "6", "--causal", "--heads", "1", "--head-dim", "2", "--dtype", "float64",
      "--json"], _memory_causal),
    (["memory", "--seq-len", "8", "--ranks", "4", "--heads", "2", "--head-dim", "4", "--json"], _memory_ring),
    (["memory", "--seq-len", "100000000000000000000", "--json"], _memory_huge),
    (["pattern", "causal", "--seq-len", "4", "--json"], _density(4, lambda i, j: j <= i)),
    (["pattern", "full", "--seq-len", "3", "--json"], _density(3, lambda i, j: True)),
    (["pattern", "sliding_window", "--window", "1", "-n", "5", "--json"], _density(5, lambda i, j: abs(i - j) <= 1)),
    (["pattern", "documents", "--lengths", "2,2", "-n", "4", "--json"], _density(4, lambda i, j: i // 2 == j // 2)),
    (["backends", "--json"], _backends),
]


@pytest.mark.parametrize("args,check", VALID, ids=lambda x: " ".join(x)[:60] if isinstance(x, list) else None)
def test_odd_but_valid_command_lines(args, check, capsys, no_load):
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert check(json.loads(out)), out


@functools.cache
def _tm():
    """headlab's own small decoder (vocabulary 20, 2 layers, 2 heads)."""
    from headlab.models.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    return Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, causal=True)).eval()


@functools.cache
def _llama():
    """A tiny Llama with its tokenizer (2 layers, 4 heads, 2 kv heads, 64 positions)."""
    from test_probing import tiny_llama

    return tiny_llama()


Q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))  # (B, H, T, D)
S = costs.AttentionShape(heads=2, q_len=4, head_dim=8)
IDS = torch.tensor([[1, 2, 3]])


def api(name, call, exc, match, before, fix=None):
    assert before in CLASSES
    return pytest.param(call, exc, match, before, id=name, marks=[xf(fix)] if fix else [])


def _kv():
    from headlab.decode import kv

    return kv


def _capture(ids, site="blocks.*.attn.pattern"):
    return headlab.capture(_tm(), ids, site)


API_REFUSED = [
    # headlab.attention: shapes that disagree, dtypes, names, numbers
    api("attention head_dim 8 vs 7", lambda f: headlab.attention(Q, torch.randn(1, 2, 4, 7), Q), ShapeError,
        r"same head_dim", "clean"),
    api("attention 3-D q", lambda f: headlab.attention(Q[0], Q[0], Q[0]), ShapeError, r"must have 4 dims", "clean"),
    api("attention int q", lambda f: headlab.attention(Q.long(), Q.long(), Q.long()), DTypeError, r"floating", "clean"),
    api("attention 3 heads vs 2 kv", lambda f: headlab.attention(torch.randn(1, 3, 4, 8), Q, Q), ShapeError,
        r"multiple of kv heads", "clean"),
    api("attention backend bogus", lambda f: headlab.attention(Q, Q, Q, backend="bogus"), UnknownBackendError,
        r"unknown backend 'bogus'", "clean"),
    api("attention dropout 1.5", lambda f: headlab.attention(Q, Q, Q, dropout_p=1.5), ConfigError, r"\[0, 1\)",
        "clean"),
    api("attention dropout nan", lambda f: headlab.attention(Q, Q, Q, dropout_p=math.nan), ConfigError, r"got nan",
        "clean"),
    api("attention mask 3x3", lambda f: headlab.attention(Q, Q, Q, mask=torch.ones(3, 3, dtype=torch.bool)), MaskError,
        r"does not broadcast", "clean"),
    api("attention int mask", lambda f: headlab.attention(Q, Q, Q, mask=torch.ones(4, 4, dtype=torch.int32)),
        MaskError, r"must be a boolean tensor", "clean"),
    api("attention scale nan", lambda f: headlab.attention(Q, Q, Q, scale=math.nan), ConfigError, r"finite", "clean"),
    api("attention scale str", lambda f: headlab.attention(Q, Q, Q, scale="x"), ConfigError, r"scale must be a number",
        "clean"),
    api("attention q a list", lambda f: headlab.attention([[1.0]], Q, Q), ShapeError, r"torch.Tensor", "clean"),
    api("attention batch 1 vs 2", lambda f: headlab.attention(Q, Q.repeat(2, 1, 1, 1), Q.repeat(2, 1, 1, 1)),
        ShapeError, r"batch sizes differ", "clean"),
    api("attention k 5 vs v 4", lambda f: headlab.attention(Q, torch.randn(1, 2, 5, 8), Q), ShapeError,
        r"k and v must agree", "clean"),
    api("attention empty sequence", lambda f: headlab.attention(Q[:, :, :0], Q[:, :, :0], Q[:, :, :0]), ShapeError,
        r"empty dimension", "clean"),
    # MultiHeadAttention
    api("mha 16 / 3 heads", lambda f: headlab.MultiHeadAttention(16, 3), ConfigError, r"not divisible", "clean"),
    api("mha embed 0", lambda f: headlab.MultiHeadAttention(0, 4), ConfigError, r"must be positive", "clean"),
    api("mha kv heads 3 of 4", lambda f: headlab.MultiHeadAttention(16, 4, num_kv_heads=3), ConfigError,
        r"multiple of num_kv_heads=3", "clean"),
    api("mha embed 16.0", lambda f: headlab.MultiHeadAttention(16.0, 4), ConfigError, r"embed_dim must be an integer",
        "untyped"),
    api("mha backend bogus", lambda f: headlab.MultiHeadAttention(16, 4, backend="bogus"), UnknownBackendError,
        r"unknown backend 'bogus'", "bug"),  # was: accepted, refused only at the first call
    api("mha width 12 for 16", lambda f: headlab.MultiHeadAttention(16, 4)(torch.randn(1, 5, 12)), ShapeError,
        r"expects embed_dim=16", "clean"),
    api("mha 2-D input", lambda f: headlab.MultiHeadAttention(16, 4)(torch.randn(5, 16)), ShapeError,
        r"\(batch, seq, features\)", "clean"),
    api("mha key padding (1, 4) for 5", lambda f: headlab.MultiHeadAttention(16, 4)(
        torch.randn(1, 5, 16), key_padding_mask=torch.ones(1, 4, dtype=torch.bool)), MaskError, r"\(1, 5\)", "clean"),
    # the cost model
    api("shape heads True", lambda f: costs.AttentionShape(heads=True), ConfigError, r"heads must be a positive",
        "silently wrong"),  # was: costed as one head
    api("shape heads 2.5", lambda f: costs.AttentionShape(heads=2.5), ConfigError, r"got 2.5", "clean"),
    api("shape head_dim '64'", lambda f: costs.AttentionShape(head_dim="64"), ConfigError, r"got '64'", "clean"),
    api("shape dtype int8", lambda f: costs.AttentionShape(dtype="int8"), ConfigError, r"unknown dtype", "clean"),
    api("shape dropout 2", lambda f: costs.AttentionShape(dropout_p=2.0), ConfigError, r"dropout_p must be a number",
        "silently wrong"),
    api("estimate a dict", lambda f: costs.estimate({"heads": 2}, "reference"), ConfigError,
        r"estimate costs an AttentionShape, got dict", "untyped"),
    api("estimate bogus backend", lambda f: costs.estimate(S, "bogus"), UnknownBackendError, r"'bogus'", "clean"),
    api("ring 0 ranks", lambda f: costs.ring_cost(S, 0), ConfigError, r"ranks must be a positive integer", "clean"),
    api("ring 3 ranks for 4", lambda f: costs.ring_cost(S, 3), ShapeError, r"equal shards", "clean"),
    api("ring 2.0 ranks", lambda f: costs.ring_cost(S, 2.0), ConfigError, r"got 2.0", "clean"),
    api("kv bytes -1 tokens", lambda f: costs.kv_cache_bytes([[-1]], head_dim=8), ConfigError, r"cannot keep -1",
        "clean"),
    api("full cache -1 layers", lambda f: costs.full_cache_bytes(layers=-1, kv_heads=2, tokens=4, head_dim=8),
        ConfigError, r"layers must be a positive integer, got -1", "silently wrong"),  # was: 0 bytes
    api("full cache dtype bogus", lambda f: costs.full_cache_bytes(layers=1, kv_heads=2, tokens=4, head_dim=8,
                                                                   dtype="bogus"), ConfigError, r"unknown dtype",
        "clean"),
    api("hardware peak -1", lambda f: costs.Hardware("x", peak_flops=-1, bandwidth=1e9), ConfigError,
        r"peak_flops must be a positive finite number", "silently wrong"),  # was: a negative time
    api("hardware bandwidth 0", lambda f: costs.Hardware("x", peak_flops=1e12, bandwidth=0), ConfigError,
        r"bandwidth must be a positive finite", "untyped"),  # was: ZeroDivisionError in seconds()
    api("parse_dtype bogus", lambda f: costs.parse_dtype("bogus"), ConfigError, r"unknown dtype 'bogus'", "clean"),
    # headlab.load: a folder that is not a model, wrong types
    api("load a folder", lambda f: headlab.load(f["dir"]), ModelError, r"not a Hugging Face model folder", "clean"),
    api("load a file", lambda f: headlab.load(f["file"]), ModelError, r"is a file", "clean"),
    api("load a missing path", lambda f: headlab.load(f["tmp"] / "none"), ModelError, r"unknown model", "clean"),
    api("load ''", lambda f: headlab.load(""), ModelError, r"the model name is empty", "clean"),
    api("load None", lambda f: headlab.load(None), ConfigError, r"got NoneType", "untyped"),
    api("load 5", lambda f: headlab.load(5), ConfigError, r"got int 5", "untyped"),
    api("load unknown model type", lambda f: headlab.load(f["notmodel"]), ModelError, r"not a Hugging Face config",
        "clean"),
    api("load config not JSON", lambda f: headlab.load(f["badcfg"]), ModelError, r"not a Hugging Face config", "clean"),
    api("load dtype 'bogus'", lambda f: headlab.load("minilm", dtype="bogus"), ConfigError, r"unknown dtype 'bogus'",
        "untyped"),
    api("load dtype int64", lambda f: headlab.load("minilm", dtype=torch.int64), ConfigError, r"floating torch dtype",
        "clean"),  # was: a ModelError too, after reading the config
    # headlab.capture
    api("capture site bogus", lambda f: _capture(IDS, "bogus.site"), SiteError, r"matches nothing", "clean"),
    api("capture site ''", lambda f: _capture(IDS, ""), SiteError, r"site '' matches nothing", "clean"),
    api("capture layer 99", lambda f: _capture(IDS, "blocks.99.attn.pattern"), SiteError, r"matches nothing", "clean"),
    api("capture id 30 of 20", lambda f: _capture(torch.tensor([[1, 2, 30]])), InputError,
        r"token id 30 is outside the vocabulary of 20", "untyped"),  # was: IndexError from the embedding
    api("capture float ids", lambda f: _capture(torch.tensor([[1.0, 2.0]])), InputError, r"integer tensor",
        "untyped"),  # was: RuntimeError from the embedding
    api("capture empty ids", lambda f: _capture(torch.zeros(1, 0, dtype=torch.long)), ShapeError, r"empty", "clean"),
    # headlab.generate and the kv policies
    api("generate 0 tokens", lambda f: headlab.generate(_llama(), IDS, max_new_tokens=0), ConfigError,
        r"max_new_tokens must be a positive integer", "clean"),
    api("generate 2.5 tokens", lambda f: headlab.generate(_llama(), IDS, max_new_tokens=2.5), ConfigError, r"2.5",
        "clean"),
    api("generate temperature 0", lambda f: headlab.generate(_llama(), IDS, sample=True, temperature=0.0), ConfigError,
        r"temperature must be > 0", "clean"),
    api("generate empty prompt", lambda f: headlab.generate(_llama(), ""), InputError, r"empty", "clean"),
    api("generate batch of 2", lambda f: headlab.generate(_llama(), IDS.repeat(2, 1)), InputError, r"\(2, 3\)",
        "clean"),
    api("generate id 10**6", lambda f: headlab.generate(_llama(), torch.tensor([[1, 10 ** 6]])), InputError,
        r"vocabulary", "clean"),
    api("generate float ids", lambda f: headlab.generate(_llama(), torch.tensor([[1.0]])), InputError, r"integers",
        "clean"),
    api("generate prompt None", lambda f: headlab.generate(_llama(), None), InputError, r"got NoneType", "clean"),
    api("generate past positions", lambda f: headlab.generate(_llama(), IDS, max_new_tokens=1000), InputError,
        r"exceeds the 64 positions", "clean"),
    api("generate policy a str", lambda f: headlab.generate(_llama(), IDS, policy="streaming:4,8"), ConfigError,
        r"policy must be a headlab.kv.Policy", "clean"),
    api("generate policy layer 5", lambda f: headlab.generate(_llama(), IDS, policy=_kv().Policy.from_spec(
        {"5.0": "drop"})), ConfigError, r"names layer 5, but the model has layers 0..1", "clean"),
    api("generate top_k 0", lambda f: headlab.generate(_llama(), IDS, sample=True, top_k=0), ConfigError,
        r"top_k must be a positive integer.*got 0", "untyped"),
    api("policy parse bogus", lambda f: _kv().Policy.parse("bogus"), ConfigError, r"unknown kv rule", "clean"),
    api("policy parse streaming:a,b", lambda f: _kv().Policy.parse("streaming:a,b"), ConfigError, r"two integers",
        "clean"),
    api("policy streaming:0,0", lambda f: _kv().Policy.parse("streaming:0,0"), ConfigError, r"keeps no key", "clean"),
    api("policy bits 3", lambda f: _kv().Policy.parse("full:bits=3"), ConfigError, r"bits=3", "clean"),
    api("policy drop:bits=4", lambda f: _kv().Policy.parse("drop:bits=4"), ConfigError, r"unknown kv rule", "clean"),
    api("policy adakv 0", lambda f: _kv().Policy.adakv(0), ConfigError, r"budget=0", "clean"),
    api("policy load missing", lambda f: _kv().Policy.load(f["tmp"] / "none.json"), InputError, r"does not exist",
        "clean"),
    api("policy load latin-1", lambda f: _kv().Policy.load(f["latin1"]), InputError, r"not UTF-8", "clean"),
    api("policy load a folder", lambda f: _kv().Policy.load(f["dir"]), InputError, r"is a folder", "clean"),
    api("policy load a list", lambda f: _kv().Policy.load(f["list"]), InputError, r"expected", "clean"),
    api("policy scores (3, 3)", lambda f: _kv().Policy.from_scores(_llama(), torch.ones(3, 3), keep=0.5), ConfigError,
        r"expected \(layers, heads\) = \(2, 4\)", "clean"),
    api("policy scores NaN", lambda f: _kv().Policy.from_scores(_llama(), torch.full((2, 4), math.nan), keep=0.5),
        ConfigError, r"NaN", "clean"),
    api("policy keep nan", lambda f: _kv().Policy.from_scores(_llama(), torch.ones(2, 4), keep=math.nan), ConfigError,
        r"keep=nan", "clean"),
    api("policy random keep -0.1", lambda f: _kv().Policy.random(_llama(), keep=-0.1), ConfigError, r"keep=-0.1",
        "clean"),
    api("policy key 'x'", lambda f: _kv().Policy.from_spec({"x": "drop"}), ConfigError, r"policy key 'x'", "bug"),
    # results: read_json, Result.load / save
    api("read_json missing", lambda f: headlab.read_json(f["tmp"] / "none.json"), InputError, r"does not exist",
        "clean"),
    api("read_json folder", lambda f: headlab.read_json(f["dir"]), InputError, r"is a folder", "clean"),
    api("read_json latin-1", lambda f: headlab.read_json(f["latin1"]), InputError, r"not UTF-8", "clean"),
    api("read_json empty", lambda f: headlab.read_json(f["empty"]), InputError, r"is empty", "clean"),
    api("read_json not JSON", lambda f: headlab.read_json(f["notjson"]), InputError, r"is not JSON", "clean"),
    api("Result.load a list", lambda f: headlab.Result.load(f["list"]), InputError, r"a JSON list", "clean"),
    api("Result.load not JSON", lambda f: headlab.Result.load(f["notjson"]), InputError, r"is not JSON", "clean"),
    api("Result.save /proc", lambda f: headlab.Result("x").save("/proc/headlab-x.json"), InputError,
        r"cannot be written", "untyped"),  # was: FileNotFoundError
    api("Result.save FILE/sub", lambda f: headlab.Result("x").save(f["file"] / "sub.json"), InputError,
        r"cannot be written: Not a directory", "untyped"),
    api("Result.save a folder", lambda f: headlab.Result("x").save(f["dir"]), InputError, r"is a folder", "untyped"),
    api("masks bogus", lambda f: headlab.masks.from_string("bogus"), ConfigError, r"unknown mask pattern", "clean"),
    api("masks None", lambda f: headlab.masks.from_string(None), ConfigError, r"non-empty string", "clean"),
    api("masks sliding 0", lambda f: headlab.masks.sliding_window(0), ConfigError, r"positive integer", "clean"),
]


def _softmax_ref(q, k, v, ok):
    """Attention by its definition with a boolean visibility ``ok (Lq, Lk)``; rows that see nothing are 0."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~ok, -math.inf)
    w = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return w @ v


def _v():
    return torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(1))


def _scale_zero():  # every key weighs the same: the mean of the values
    torch.testing.assert_close(headlab.attention(Q, Q, _v(), scale=0.0), _v().mean(2, keepdim=True).expand(1, 2, 4, 8))


def _nothing_visible():  # documented: a row that sees no key is zeros
    out = headlab.attention(Q, Q, _v(), mask=torch.zeros(4, 4, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))


def _causal_more_queries():  # 5 queries, 3 keys, top-left causal: queries 2.. see every key
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    ok = torch.arange(3)[None, :] <= torch.arange(5)[:, None]
    torch.testing.assert_close(headlab.attention(q, k, v, causal=True), _softmax_ref(q, k, v, ok))


def _causal_and_mask():  # both apply: a key must be earlier and allowed
    m = torch.tensor([[1, 0, 1, 1]] * 4, dtype=torch.bool)
    ok = m & (torch.arange(4)[None, :] <= torch.arange(4)[:, None])
    torch.testing.assert_close(headlab.attention(Q, Q, _v(), causal=True, mask=m), _softmax_ref(Q, Q, _v(), ok))


def _one_key():  # one key: its value, whatever the score
    v = torch.randn(1, 2, 1, 8)
    torch.testing.assert_close(headlab.attention(Q, Q[:, :, :1], v), v.expand(1, 2, 4, 8))


def _nan_value_unseen():  # a NaN value poisons only the rows that can see it (documented)
    v = _v()
    v[:, :, 3] = math.nan
    out = headlab.attention(Q, Q, v, causal=True)
    assert torch.isfinite(out[:, :, :3]).all() and torch.isnan(out[:, :, 3]).all()


def _zero_tokens_cache():  # an empty cache holds no bytes
    assert costs.full_cache_bytes(layers=2, kv_heads=2, tokens=0, head_dim=8) == 0
    assert costs.kv_cache_bytes([[], []], head_dim=8) == 0


def _one_rank_ring():  # one rank: the whole sequence, nothing sent
    c = costs.ring_cost(S, 1)
    assert c.shard_len == 4 and c.sent_forward_bytes == 0


def _kv_len_one():  # decoding one query over 1000 keys: the reference map is 1 x 1000 per head
    c = costs.estimate(costs.AttentionShape(heads=2, q_len=1, kv_len=1000, head_dim=8, dtype="float16"), "reference")
    assert c.attention_weights_bytes == 2 * 1 * 1000 * 2


API_VALID = [pytest.param(f, id=f.__name__.strip("_")) for f in (
    _scale_zero, _nothing_visible, _causal_more_queries, _causal_and_mask, _one_key, _nan_value_unseen,
    _zero_tokens_cache, _one_rank_ring, _kv_len_one)]


@pytest.mark.parametrize("call,exc,match,before", API_REFUSED)
def test_library_refuses_with_a_typed_error(call, exc, match, before, tmp_path):
    with pytest.raises(HeadlabError, match=match) as e:
        call(_files(tmp_path))
    assert isinstance(e.value, exc), type(e.value)


@pytest.mark.parametrize("call", API_VALID)
def test_library_odd_but_valid(call):
    call()


def test_every_row_has_a_class():
    rows = [p.values for p in (*REFUSED, *LOAD_REFUSES)] + [(None, None, None, r.values[3]) for r in API_REFUSED]
    assert all(r[1 if len(r) == 3 else 3] in CLASSES for r in rows)
    assert len(REFUSED) + len(LOAD_REFUSES) + len(VALID) + len(API_REFUSED) + len(API_VALID) >= 150
