"""The named checks (:mod:`headlab.checks`) and the API inputs that issue 39's census found untyped.

- every named check: what it accepts (NumPy integers included), what it refuses (a bool is never a count, NaN
  and infinity never a bound number), the one message form, the typed error it raises, and a message of a
  command's own wording;
- a padding mask with fewer lengths than the batch, fractional or missing lengths, a dense mask of no size;
- a half-precision (or integer, or elsewhere) input to :class:`headlab.MultiHeadAttention` whose weights are
  float32, and the module's own arguments;
- KV rules that a decode cannot run, refused when they are built (by function and by class);
- policy files whose ``"heads"`` are not a mapping, and the ``heads.json`` of ``headlab analyze``, given to
  ``Policy.load``, ``--kv-policy`` and ``--kv-from``;
- ``WORLD_SIZE`` above 1 outside torchrun.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

import headlab
from headlab import checks
from headlab.errors import (ConfigError, DeviceError, DistributedError, DTypeError, HeadlabError, InputError,
                            MaskError)


# -- the named checks ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("check,args,good", [
    (checks.integer, (), [0, -3, 7, np.int64(5)]),
    (checks.positive_int, (), [1, 10 ** 30, np.int32(2)]),
    (checks.non_negative_int, (), [0, 4]),
    (checks.int_at_least, (8,), [8, 9]),
    (checks.int_in_range, (1, 1000), [1, 1000]),
    (checks.number, (), [0, -2.5, math.nan, math.inf, np.float32(1.5)]),
    (checks.at_least, (1,), [1, 1.5, 10 ** 400]),
    (checks.finite_float, (), [0, -1e300, 3]),
    (checks.positive_float, (), [1e-300, 5]),
    (checks.in_range, (0, 1), [0, 0.5, 1]),
    (checks.probability, (), [0, 1, 0.25]),
])
def test_a_check_returns_what_it_accepts(check, args, good):
    for v in good:
        got = check("x", v, *args)
        assert got == v or (math.isnan(v) and math.isnan(got))
        if check in (checks.integer, checks.positive_int, checks.non_negative_int, checks.int_at_least,
                     checks.int_in_range):
            assert type(got) is int  # a NumPy integer comes back as a Python one (JSON writes it)


@pytest.mark.parametrize("check,args,bad,expected", [
    (checks.integer, (), [True, 2.0, "3", None], "an integer"),
    (checks.positive_int, (), [0, -1, True, 1.0, "1"], "a positive integer"),
    (checks.non_negative_int, (), [-1, False, 0.0], "an integer >= 0"),
    (checks.int_at_least, (8,), [7, 8.0, True], "an integer >= 8"),
    (checks.int_in_range, (1, 1000), [0, 1001, 5.0], "an integer in 1..1000"),
    (checks.number, (), [True, "1", None, torch.tensor(1.0)], "a number"),
    (checks.at_least, (1,), [0, 0.99, True, "2"], "at least 1"),
    (checks.at_least, (1,), [math.nan, -math.inf, math.inf], "a finite number of at least 1"),
    (checks.at_least, (1,), [math.inf], "a finite number of at least 1"),
    (checks.finite_float, (), [math.nan, -math.inf, True, "1"], "a finite number"),
    (checks.positive_float, (), [0, -1, math.inf, math.nan, False], "a positive finite number"),
    (checks.in_range, (0, 1), [-0.01, 1.01, math.nan, True], r"a number in \[0, 1\]"),
    (checks.probability, (), [2, -1, math.nan], r"a number in \[0, 1\]"),
    (checks.boolean, (), [0, 1, "yes", None], "True or False"),
])
def test_a_check_refuses_with_its_one_message(check, args, bad, expected):
    for v in bad:
        with pytest.raises(ConfigError, match=rf"^x must be {expected}, got ") as e:
            check("x", v, *args)
        assert str(e.value).endswith(str(v) if checks.is_number(v) else repr(v)), e.value


def test_what_hint_error_and_a_message_of_its_own():
    with pytest.raises(ConfigError, match=r"^--width must be at least 1 character, got 0$"):
        checks.at_least("--width", 0, 1, what=" character")  # the CLI's check_at_least, word for word
    with pytest.raises(ConfigError, match=r"^n_boot must be an integer >= 2, got 1; 1000 is the default$"):
        checks.int_at_least("n_boot", 1, 2, hint="; 1000 is the default")
    with pytest.raises(InputError, match=r"^target must be an integer, got 'a'$"):
        checks.integer("target", "a", error=InputError)
    with pytest.raises(ConfigError, match=r"^budget=0 must be at least 1 \(a whole number\)$"):
        checks.int_at_least("budget", 0, 1, message="{name}={value!r} must be at least {low} (a whole number)")
    with pytest.raises(ConfigError, match=r"^n=1,000,000 is too many$"):
        checks.int_in_range("n", 10 ** 6, 1, 10, message="{name}={value:,} is too many")
    with pytest.raises(ConfigError, match=r"in_range: a number in \(0, 1\)"):
        checks.in_range("in_range", 0, 0, 1, low_open=True, high_open=True,
                        message="{name}: a number in ({low}, {high})")


def test_index_and_one_of():
    assert checks.index("layer", -1, 4) == 3 and checks.index("layer", 2, 4, negative=False) == 2
    with pytest.raises(ConfigError, match=r"^layer must be an index into 4 items \(0\.\.3\), got -1$"):
        checks.index("layer", -1, 4, negative=False)
    with pytest.raises(ConfigError, match=r"\(-4\.\.3\), got 4$"):
        checks.index("layer", 4, 4)
    with pytest.raises(ConfigError, match=r"layer 9 of 4 \(0\.\.3\)"):
        checks.index("layer", 9, 4, message="layer {value} of {length} ({low}..{high})", negative=False)
    assert checks.one_of("mode", "exact", ("exact", "approx")) == "exact" and checks.one_of("bits", 4, (16, 4)) == 4
    with pytest.raises(ConfigError, match=r"^unknown mode 'fast'; choose one of exact, approx$"):
        checks.one_of("mode", "fast", ["exact", "approx"])
    with pytest.raises(ConfigError, match=r"unknown bits True"):
        checks.one_of("bits", True, (16, 8, 1))  # True == 1, but a flag is not a bit width


def test_no_inline_integer_check_is_left_in_the_source():
    """Every check of the kind ``isinstance(x, bool) or not isinstance(x, int)`` is a named check now."""
    from pathlib import Path

    src = Path(headlab.__file__).parent
    pattern = re.compile(r"isinstance\([^)]*, bool\) or not isinstance\(|not isinstance\([^)]*, int\) or "
                         r"isinstance\([^)]*, bool\)")
    left = [f"{p.relative_to(src)}:{i}" for p in src.rglob("*.py") if p.name != "checks.py"
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not left, left


def test_checks_sits_in_the_base_layer():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(checks.__file__).read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "math", "numbers", "collections.abc", "headlab.errors"}, imported


# -- masks ----------------------------------------------------------------------------------------------------------
Q = torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(0))


def test_a_padding_mask_with_fewer_lengths_than_the_batch_is_refused_where_it_meets_the_batch():
    m = headlab.masks.padding([3])  # one length, a batch of two: an IndexError in the mask's function before
    with pytest.raises(MaskError, match=r"^padding\(\[3\]\) has 1 length \(it was built for batch size 1\) but the "
                                        r"call has a batch of 2; give one "):
        m.dense(batch=2, heads=1, q_len=4, kv_len=4)
    for backend in ("reference", "tiled", "auto"):
        with pytest.raises(MaskError, match=r"padding\(\[3\]\) has 1 length .*but the call has a batch of 2"):
            headlab.attention(Q, Q, Q, mask=m, backend=backend)
    with pytest.raises(MaskError, match=r"was built for batch size 1 but the call has batch 2"):
        headlab.attention(Q, Q, Q, mask=m & headlab.masks.causal())
    with pytest.raises(MaskError, match=r"padding\(\[3, 4, 4\]\) has 3 lengths .*but the call has a batch of 2"):
        headlab.attention(Q, Q, Q, mask=headlab.masks.padding([3, 4, 4]))
    # one length per element still runs, and one length for a batch of one
    out = headlab.attention(Q, Q, Q, mask=headlab.masks.padding([3, 4]), backend="reference")
    ref = headlab.attention(Q, Q, Q, mask=torch.arange(4)[None, None, None, :] < torch.tensor([3, 4]).view(2, 1, 1, 1),
                            backend="reference")
    torch.testing.assert_close(out, ref)
    assert m.dense(q_len=4).shape == (1, 1, 4, 4) and headlab.masks.padding(3).dense(q_len=4).shape == (1, 1, 4, 4)


@pytest.mark.parametrize("lengths,match", [
    ([2.5], r"padding lengths must be whole numbers, one per batch element; got \[2.5\]"),
    ([math.inf], r"padding lengths must be whole numbers"),
    ([True, False], r"padding lengths must be whole numbers"),
    (None, r"padding\(lengths\) needs one length per batch element .*got NoneType"),
    ("abc", r"padding\(lengths\) needs one length per batch element .*got str"),
    ([[1], [2, 3]], r"padding\(lengths\) needs one length per batch element .*got list"),
    ([], r"got an empty list"),
    ([3, -1], r"padding lengths must be >= 0, got \[3, -1\]"),
])
def test_padding_lengths_that_are_not_whole_numbers_are_refused(lengths, match):
    with pytest.raises(ConfigError, match=match):
        headlab.masks.padding(lengths)


def test_padding_takes_whole_floats_and_tensors():
    assert headlab.masks.padding([2.0, 3]).lengths == [2, 3]
    assert headlab.masks.padding(torch.tensor([1, 2])).lengths == [1, 2]
    assert headlab.masks.padding(np.array([4])).lengths == [4]


@pytest.mark.parametrize("kwargs,match", [
    ({"batch": 0}, r"^batch must be a positive integer, got 0$"),
    ({"heads": -1}, r"^heads must be a positive integer, got -1$"),
    ({"q_len": -1}, r"^q_len must be a positive integer, got -1$"),
    ({"q_len": 4, "kv_len": 2.0}, r"^kv_len must be a positive integer, got 2.0$"),
])
def test_a_dense_mask_of_no_size_is_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        headlab.masks.causal().dense(**kwargs)


# -- MultiHeadAttention ---------------------------------------------------------------------------------------------
X = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_input_to_a_float32_module_says_both_dtypes_and_the_cure(dtype):
    m = headlab.MultiHeadAttention(16, 4)
    name = str(dtype)
    with pytest.raises(DTypeError, match=rf"^query is {name} but the module's weights are torch.float32; cast the "
                                         rf"module \(module.to\({name}\)\) or the input \(query.to\(torch.float32\)\)"):
        m(X.to(dtype))
    with pytest.raises(DTypeError, match=rf"^key is {name} but the module's weights are torch.float32"):
        m(X, X.to(dtype))
    out, _ = m.to(dtype)(X.to(dtype))  # the first cure
    assert out.dtype == dtype
    out32, _ = headlab.MultiHeadAttention(16, 4)(X.to(dtype).float())  # the second
    assert out32.dtype == torch.float32


def test_autocast_still_runs_a_float32_module_on_half_inputs():
    m = headlab.MultiHeadAttention(16, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = m(X.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_integer_and_elsewhere_inputs_are_typed():
    m = headlab.MultiHeadAttention(16, 4)
    with pytest.raises(DTypeError, match=r"^query is torch.int64, but attention needs floating-point inputs"):
        m(X.long())
    with pytest.raises(DeviceError, match=r"^query is on meta but the module's weights are on cpu; move one to "):
        m(X.to("meta"))


@pytest.mark.parametrize("kwargs,error,match", [
    ({"dropout": "x"}, ConfigError, r"^dropout must be a number, got 'x'$"),
    ({"dropout": math.nan}, ConfigError, r"^dropout must be in \[0, 1\), got nan$"),
    ({"backend": 5}, HeadlabError, r"unknown backend 5"),
    ({"kdim": 0}, ConfigError, r"^kdim must be a positive integer, got 0$"),
    ({"vdim": -3}, ConfigError, r"^vdim must be a positive integer, got -3$"),
    ({"kdim": 8.0}, ConfigError, r"^kdim must be a positive integer, got 8.0$"),
])
def test_the_module_refuses_its_own_bad_arguments_when_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        headlab.MultiHeadAttention(16, 4, **kwargs)


def test_the_module_still_takes_a_backend_object_and_other_widths():
    from headlab.attention import backends

    m = headlab.MultiHeadAttention(16, 4, kdim=8, vdim=12, backend=backends.get("reference"))
    out, _ = m(X, torch.randn(2, 3, 8), torch.randn(2, 3, 12))
    assert out.shape == (2, 5, 16)


# -- KV rules -------------------------------------------------------------------------------------------------------
def _kv():
    from headlab.decode import kv

    return kv


@pytest.mark.parametrize("make,match", [
    (lambda kv: kv.Full(bits=3), r"^bits=3: a kv head stores keys and values at 16 \(the cache's dtype\), 8, 4 or 2"),
    (lambda kv: kv.Full(bits=4.0), r"^bits=4.0: a kv head stores"),
    (lambda kv: kv.full(bits=4.0), r"^bits=4.0: a kv head stores"),
    (lambda kv: kv.window(4, 8, bits=2.0), r"^bits=2.0: a kv head stores"),
    (lambda kv: kv.Full(bits="4"), r"^bits='4': a kv head stores"),
    (lambda kv: kv.Window(4, 8, bits=5), r"^bits=5: a kv head stores"),
    (lambda kv: kv.Full(bits=4, group=3, residual=5), r"^residual=5 must be a multiple of group=3"),
    (lambda kv: kv.Full(bits=8, group=2.0, residual=4), r"^group=2.0 must be at least 1"),
    (lambda kv: kv.Window(2, 8, bits=4, group=0), r"^group=0 must be at least 1"),
    (lambda kv: kv.Window(2, 8, bits=4, residual=-32), r"^residual=-32 must be at least 0"),
    (lambda kv: kv.Window(-1, 4), r"^window sink=-1 is negative; give a count of keys >= 0"),
    (lambda kv: kv.Window(2.5, 4), r"^window sink must be an integer, got 2.5$"),
    (lambda kv: kv.Window(0, 0), r"^window\(sink=0, recent=0\) keeps no key"),
    (lambda kv: kv.Window(4, 8, compensate=1), r"^compensate must be True or False, got 1$"),
    (lambda kv: kv.Policy.parse("full:bits=3"), r"^bits=3: a kv head stores"),
    (lambda kv: kv.Policy.parse("streaming:4,256,bits=4,group=0"), r"^group=0 must be at least 1"),
])
def test_a_rule_a_decode_cannot_run_is_refused_when_it_is_built(make, match):
    """``kv.Full(bits=3)`` (the class, not the function) once ran a 3-bit cache KIVI does not define, and
    ``kv.Window(-1, 4)`` or ``group=0`` failed inside the decode (a RuntimeError, a ZeroDivisionError)."""
    with pytest.raises(ConfigError, match=match):
        make(_kv())


def test_the_rules_that_run_are_still_built_and_read_back():
    kv = _kv()
    assert kv.full(bits=4) == kv.Full(4) and kv.full(bits=8, group=16, residual=64).residual == 64
    assert kv.Full() == kv.full and kv.Full(bits=16, group=1, residual=1).bits == 16  # 16 bits ignores them
    w = kv.window(4, 256, bits=2, compensate=True)
    assert kv.as_rule(w.text()) == w and kv.Window(4, 256) == kv.window(4, 256)
    assert kv.Policy.parse("streaming:4,256,bits=4,group=32,residual=128").default.bits == 4


def _tiny_llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_every_quantized_rule_that_is_built_decodes():
    """The rules a construction accepts run: bits 8, 4, 2 over groups and residuals that divide, windows
    with and without compensation (head_dim 16, so group 16 divides it)."""
    kv = _kv()
    model = _tiny_llama()
    ids = torch.randint(0, 61, (1, 21), generator=torch.Generator().manual_seed(3))
    for rule in (kv.full(bits=8, group=4, residual=8), kv.Full(4, 16, 16), kv.window(2, 5, bits=2, group=2, residual=4),
                 kv.Window(1, 6, 4, 4, 4, True)):
        gen = headlab.generate(model, ids, policy=kv.Policy.uniform(rule), max_new_tokens=3, stop_at_eos=False)
        assert gen.ids.shape == (1, 3) and torch.isfinite(gen.step_logits).all(), rule


# -- policy files ---------------------------------------------------------------------------------------------------
def _heads_json(path):
    """What ``headlab analyze`` / ``headlab demo`` write as heads.json: the per-head table in the result envelope."""
    from headlab.results import envelope

    path.write_text(json.dumps(envelope("analyze", {"model": "m", "tokens": ["a", "b"], "heads": [
        {"layer": 0, "head": 0, "labels": ["previous-token"]}]}, model="m")))
    return path


@pytest.fixture
def policy_files(tmp_path):
    files = {"null": '{"default": "full", "heads": null}', "list": '{"default": "full", "heads": [1]}',
             "none": '{"heads": null}', "string": '{"heads": "0.0"}'}
    out = {k: tmp_path / f"{k}.json" for k in files}
    for k, text in files.items():
        out[k].write_text(text)
    out["analyze"] = _heads_json(tmp_path / "heads.json")
    out["atlas"] = tmp_path / "atlas.json"
    out["atlas"].write_text(json.dumps({"headlab": {"kind": "head_atlas", "version": headlab.__version__},
                                        "scores": {}}))
    return out


EXPECT = {"null": r"\"heads\" must be an object \{\"layer.kv_head\": rule\}, got null; a policy file holds",
          "list": r"\"heads\" must be an object .*got a list of 1 item",
          "none": r"\"heads\" must be an object .*got null",
          "string": r"\"heads\" must be an object .*got str '0.0'",
          "analyze": r"expected a KV policy, \{\"default\": ..., \"heads\".*; it holds a result of kind 'analyze', the "
                     r"per-head table headlab analyze and headlab demo write as heads.json",
          "atlas": r"holds a result of kind 'head_atlas', an atlas: give it to --kv-from with --keep"}


@pytest.mark.parametrize("name", list(EXPECT))
def test_policy_load_says_what_the_file_holds(policy_files, name):
    with pytest.raises(InputError, match=r"^policy file '.*': ") as e:
        _kv().Policy.load(policy_files[name])
    assert re.search(EXPECT[name], str(e.value)), e.value


@pytest.mark.parametrize("name", ["null", "list", "analyze"])
def test_kv_policy_and_kv_from_refuse_them_in_one_line_before_any_load(policy_files, name, no_load, capsys):
    from conftest import run_cli

    code, out, err = run_cli(["memory", "--seq-len", "64", "--kv-policy", policy_files[name]], capsys)
    assert code == 2 and err.count("\n") == 1 and re.search(EXPECT[name], err), err
    code, out, err = run_cli(["generate", "hi", "--kv-from", policy_files[name]], capsys)
    assert code == 2 and err.count("\n") == 1 and re.search(r"--kv-from '.*'.*" + EXPECT[name], err), err


def test_policy_spec_of_the_wrong_shape():
    kv = _kv()
    with pytest.raises(ConfigError, match=r"a policy spec must be an object .*got NoneType"):
        kv.Policy.from_spec(None)
    with pytest.raises(ConfigError, match=r"policy key '0.-1' names layer 0, kv head -1: layers and kv heads count "):
        kv.Policy.from_spec({"0.-1": "drop"})
    with pytest.raises(ConfigError, match=r"policy key \(True, 0\)"):
        kv.Policy.from_spec({(True, 0): "drop"})
    assert kv.Policy.from_spec({"1.0": "drop", (0, 1): "full:bits=4"}).rules[(1, 0)] == kv.drop


def test_a_policy_file_still_loads(tmp_path):
    kv = _kv()
    p = kv.Policy.from_spec({"0.1": "window:4,8"}, name="mine")
    back = kv.Policy.load(p.save(tmp_path / "p.json"))
    assert back.rules == p.rules and back.name == "mine"
    (tmp_path / "old.json").write_text('{"default": "full", "heads": {"0.0": "drop"}, "name": 5}')  # no header
    old = kv.Policy.load(tmp_path / "old.json")
    assert old.rules == {(0, 0): kv.drop} and old.name == "old"


# -- distributed ----------------------------------------------------------------------------------------------------
@pytest.fixture
def outside_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for v in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)


def test_world_size_outside_torchrun_says_to_run_under_torchrun(outside_torchrun, monkeypatch):
    from headlab.distributed.data import init_from_env

    with pytest.raises(DistributedError, match=r"^WORLD_SIZE=2 says this is one of 2 processes, but MASTER_ADDR, "
                                               r"MASTER_PORT are not set; start the command under torchrun"):
        init_from_env()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(DistributedError, match=r"^RANK='2' is not a rank of WORLD_SIZE=2 \(0\.\.1\)"):
        init_from_env()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(DistributedError, match=r"^WORLD_SIZE='two' is not a number of processes"):
        init_from_env()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_from_env() == (0, 1)


def test_a_group_that_cannot_be_joined_is_typed(outside_torchrun, monkeypatch):
    import torch.distributed as dist

    from headlab.distributed import data

    def refuse(*a, **k):
        raise ValueError("Error initializing torch.distributed using env:// rendezvous: bad address\nmore")

    monkeypatch.setenv("MASTER_ADDR", "nowhere.invalid")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(dist, "init_process_group", refuse)
    with pytest.raises(DistributedError, match=r"^could not join the process group of 2 processes \(RANK=0, "
                                               r"MASTER_ADDR=nowhere.invalid, MASTER_PORT=29500\): Error initializing "
                                               r"torch.distributed using env:// rendezvous: bad address; start the"):
        data.init_from_env()


def test_analyze_with_world_size_outside_torchrun_is_one_line_and_writes_nothing(outside_torchrun, no_load, tmp_path,
                                                                                   capsys):
    from conftest import run_cli

    code, out, err = run_cli(["analyze", "a b", "--tensor-parallel", "--out", tmp_path / "o"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "MASTER_ADDR, MASTER_PORT are not set; start the command under torchrun" in err, err
    assert not (tmp_path / "o").exists()
