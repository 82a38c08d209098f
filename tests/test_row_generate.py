"""``headlab generate`` and ``headlab train-gates`` are rows: registered instruments whose declared options are the
commands' options, checked before any load; Ctrl-C in generate's one unit keeps nothing and says so (exit 130),
train-gates' steps are units (Ctrl-C keeps them, exit 130, --resume continues); a generation's envelope carries
each rank's KV bytes."""

from __future__ import annotations

import dataclasses
import importlib
import json
import shlex

import pytest
import torch
import transformers

import headlab
import headlab.cli.main  # noqa: F401  (every command, so every instrument, registered)
from conftest import command_params, run_cli, save_word_level
from headlab import kv
from headlab.costs.tensor_parallel import kv_cache_bytes_per_rank
from headlab.errors import ConfigError
from headlab.interpret.instruments import REQUIRED, get, runner
from headlab.results import Result

WORDS = ["<pad>", "<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "park", "and", ".", "pass", "key",
         "for", "is", "red", "door", "recite", "keys"]
PROMPT = "the cat sat on the mat and the dog ran to the park ."


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=256, attn_implementation="eager")).eval()
    return save_word_level(tmp_path_factory.mktemp("tiny-llama"), model, WORDS)


@pytest.mark.parametrize("command, instrument, extra", [
    (("generate",), "generate", {"policy": {"--kv-policy"}}),
    (("train-gates",), "train-gates", {}),
])
def test_the_commands_are_rows_of_their_instruments(command, instrument, extra):
    inst = get(instrument)
    params = command_params(*command)
    for o in (o for o in inst.options if not o.python):  # a Python-only option (train_gates' data) has no flag
        p = params.pop(o.name)
        names = set(p.opts) | set(p.secondary_opts)
        assert names == ({o.flag} if o.flag else {o.name}) | ({o.short} if o.short else set()) | extra.get(o.name, set())
        assert p.required if o.default is REQUIRED else p.default == o.default
    # what the row adds: tensor parallelism for generate (generate() shards its cache by heads), --resume for
    # train-gates (its steps are units)
    assert set(params) == ({"tensor_parallel", "tensor_size"} if inst.sharded is True else set()) | \
        ({"resume"} if inst.resumable else set())
    assert isinstance(get("train-gates").sharded, str)


@pytest.mark.parametrize("args, said", [
    (["generate", "hi", "--top-k", "0"], "--top-k must be at least 1, got 0"),
    (["generate", "hi", "--kv-policy", "streaming:4"], "SINK,RECENT"),
    (["generate", "hi", "--model", "minilm", "-n", "600"], "--max-new-tokens 600: with the prompt it must fit in the "
                                                          "512 positions of minilm; give at most 511"),
    (["train-gates", "--out", "{tmp}/g.json", "--window", "4"], "--window '4': write SINK,RECENT"),
    (["train-gates", "--out", "{tmp}/g.json", "--window", "4,256", "--tokens", "300"],
     "--tokens must be at least 324 (the window's sink + recent + 64), got 300"),
    (["train-gates", "--out", "{tmp}/g.json", "--model", "minilm", "--tokens", "600", "--window", "1,8"],
     "--tokens 600: minilm reads at most 512 positions"),
    (["train-gates", "--out", "{tmp}/g.json", "--checkpoint", "{tmp}"], "is not a file"),
    (["train-gates", "--out", "{tmp}/g.json", "--tensor-parallel"], "No such option: --tensor-parallel"),
])
def test_a_bad_option_is_refused_before_any_load(args, said, tmp_path, capsys, no_load):
    code, out, err = run_cli([a.format(tmp=tmp_path) for a in args], capsys)
    assert code == 2 and said in err and err.count("\n") == 1, err


def test_the_runner_checks_the_options_in_the_cli_words_without_the_cli(no_load):
    with pytest.raises(ConfigError, match=r"--seed: it acts only on sampling; add --sample"):
        runner.run("generate", {"prompt": "hi", "seed": 3})
    with pytest.raises(ConfigError, match=r"--lr must be at least 1e-09, got 0.0"):
        runner.run("train-gates", {"out": "g.json", "lr": 0.0})


def test_without_the_peek_the_positions_are_checked_on_the_loaded_model_before_the_work(tiny_folder, monkeypatch):
    G = importlib.import_module("headlab.decode.generate")  # the package's "generate" is the function

    gen = get("generate")
    monkeypatch.setattr(importlib.import_module("headlab.models.peek"), "peek_max_positions", lambda model: None)
    monkeypatch.setattr(G, "generate", lambda *a, **k: pytest.fail("generate ran"))
    with pytest.raises(ConfigError, match="--max-new-tokens 256: .* the 256 positions of .*; give at most 255"):
        runner.run(gen, {"prompt": PROMPT, "model": str(tiny_folder), "max_new_tokens": 256})


def test_ctrl_c_in_generation_keeps_nothing_and_says_so(tiny_folder, tmp_path, capsys, monkeypatch):
    """One prompt is one unit: an interrupted generation has nothing finished to keep; exit 130, one line."""
    G = importlib.import_module("headlab.decode.generate")  # the package's "generate" is the function

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(G, "generate", interrupted)
    out = tmp_path / "g.json"
    code, so, err = run_cli(["generate", PROMPT, "--model", tiny_folder, "-n", "2", "--out", out], capsys)
    assert code == 130 and so == "" and not out.exists()
    assert err.strip() == "interrupted: kept 0 of 1 units nothing was written (no unit had finished)"


def test_train_gates_keeps_its_steps_on_ctrl_c_exits_130_and_resume_ends_with_the_uninterrupted_gates(
        tiny_folder, tmp_path, capsys, monkeypatch):
    """The steps are the runner's units: Ctrl-C in step 2 keeps step 1 in --out, exits 130 with the runner's line;
    the same command with --resume runs steps 2 and 3 only and ends with the gates, losses and steps of an
    uninterrupted run with the same seed."""
    import headlab.decode.train as T

    real, calls = T.gated, []

    def gated(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    out, straight = tmp_path / "gates.json", tmp_path / "straight.json"
    args = ["train-gates", "--model", tiny_folder, "--window", "1,8", "--tokens", "120", "--keys", "1",
            "--contexts", "2", "--steps", "3"]
    code, _, err = run_cli(args + ["--out", straight], capsys)
    assert code == 0, err
    monkeypatch.setattr(T, "gated", gated)
    code, so, err = run_cli(args + ["--out", out], capsys)
    assert code == 130 and so == "", err
    line = next(ln for ln in err.splitlines() if ln.startswith("interrupted:"))
    assert line.startswith(f"interrupted: kept 1 of 3 units in {out}; run again with --resume to finish the rest")
    printed = line.partition("finish the rest: headlab ")[2]  # the command that resumes, when the line names it
    again_args = shlex.split(printed) if printed else [*args, "--out", out, "--resume"]
    assert "--resume" in again_args
    kept = Result.load(out)
    assert kept.figures["interrupted"] == {"kept": 1, "of": 3} and list(kept.figures["units"]) == ["1"]
    assert not list(tmp_path.glob("*.ckpt"))  # no checkpoint of its own beside the runner's kept units
    monkeypatch.setattr(T, "gated", real)
    calls.clear()
    code, _, err = run_cli(args + ["--out", out], capsys)  # without --resume the kept file is not replaced
    assert code == 2 and "exists" in err
    monkeypatch.setattr(T, "gated", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    code, _, err = run_cli(again_args, capsys)
    assert code == 0, err
    assert len(calls) == 2  # steps 2 and 3 only
    again, want = kv.GateTraining.load(out), kv.GateTraining.load(straight)
    assert (again.steps, again.stopped) == (3, "steps") and again.losses == want.losses
    assert torch.equal(again.gates, want.gates)


def test_the_generate_row_writes_what_it_prints(tiny_folder, tmp_path, capsys):
    out = tmp_path / "g.json"
    code, so, err = run_cli(["generate", PROMPT, "--model", tiny_folder, "--kv-policy", "streaming:2,3", "-n", "4",
                             "--out", out, "--json"], capsys)
    assert code == 0, err
    printed, written = json.loads(so), json.loads(out.read_text())
    assert printed == written and written["prompt"] == PROMPT and written["model"] == str(tiny_folder)
    assert Result.load(out).kind == "generation" and written["kv_bytes_per_rank"] is None  # one process


def test_the_envelope_carries_each_ranks_kv_bytes_as_the_cost_model_splits_them(tiny_folder):
    """On one process the figure is None. Each rank's share, as a sharded run measures it, is what
    kv_cache_bytes_per_rank predicts: checked here by hand for a split (rank 0 holds kv head 0 of each layer,
    windowed; rank 1 kv head 1, full), and the shares add up to the bytes one process measured."""
    loaded = headlab.load(str(tiny_folder))
    policy = kv.Policy.from_spec({(0, 0): kv.window(2, 3), (1, 0): kv.window(2, 3)})
    g = headlab.generate(loaded, PROMPT, policy=policy, max_new_tokens=5, stop_at_eos=False)
    assert g.kv_bytes_per_rank is None and g.to_json()["kv_bytes_per_rank"] is None
    held = g.prompt_tokens + g.ids.shape[1] - 1
    per_rank = kv_cache_bytes_per_rank(policy, kv_heads=[2, 2], world=2, tokens=held, head_dim=8, prompt=g.prompt_tokens)
    row = 2 * 8 * 4  # (key, value) x head dim 8 x float32
    assert per_rank == [2 * min(held, 5) * row, 2 * held * row]  # 2 layers, one kv head each
    assert sum(per_rank) == g.kv_bytes  # the split adds up to what one process measured
    sharded = dataclasses.replace(g, kv_bytes_per_rank=per_rank)
    doc = json.loads(json.dumps(sharded.to_json()))
    assert doc["kv_bytes_per_rank"] == per_rank and doc["kv_bytes"] == sum(doc["kv_bytes_per_rank"])
