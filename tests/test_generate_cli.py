"""``headlab generate`` and ``headlab memory --kv-policy``: help, errors before any work (exit 2, one line),
and runs on a tiny saved Llama whose numbers are checked against the library."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import headlab
from conftest import run_cli, save_word_level
from headlab import kv
from headlab.costs.kv import full_cache_bytes, policy_cache_bytes

WORDS = ["<pad>", "<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "park", "and", "."]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    return save_word_level(folder, model, WORDS)


PROMPT = "the cat sat on the mat and the dog ran to the park ."


def test_help(capsys):
    code, out, _ = run_cli(["generate", "--help"], capsys)
    assert code == 0 and "--policy" in out and "--kv-from" in out and "streaming:SINK,RECENT" in out


def test_generate_prints_the_text_and_the_cache_against_the_full_one(tiny_folder, capsys):
    code, out, err = run_cli(["generate", PROMPT, "--model", str(tiny_folder), "--policy", "streaming:2,3",
                              "-n", "5", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    loaded = headlab.load(str(tiny_folder))
    g = headlab.generate(loaded, PROMPT, policy=kv.Policy.uniform(kv.window(2, 3)), max_new_tokens=5)
    assert doc["ids"] == g.ids[0].tolist() and doc["kv_bytes"] == g.kv_bytes
    held = doc["prompt_tokens"] + len(doc["ids"]) - 1
    assert doc["kv_bytes"] == 2 * 2 * min(held, 5) * 2 * 8 * 4  # layers x kv heads x kept x (k, v) x dim x float32
    assert doc["kv_bytes_full"] == full_cache_bytes(layers=2, kv_heads=2, tokens=held, head_dim=8)
    code, out, err = run_cli(["generate", PROMPT, "--model", str(tiny_folder), "-n", "3"], capsys)
    assert code == 0 and out.startswith(PROMPT) and "KV cache" in err and "tokens/s" in err


def test_kv_dtype_holds_the_cache_in_sixteen_bits_and_counts_it_so(tiny_folder, capsys):
    """``--kv-dtype float16``: the cache held in float16 under the float32 model, as ``generate(kv_dtype=)``; the full
    cache's bytes are a 16-bit one's."""
    argv = ["generate", PROMPT, "--model", str(tiny_folder), "--policy", "full:bits=4,group=4,residual=0", "-n", "4",
            "--json"]
    code, out, err = run_cli([*argv, "--kv-dtype", "float16"], capsys)
    assert code == 0, err
    half = json.loads(out)
    code, out, err = run_cli(argv, capsys)
    full = json.loads(out)
    g = headlab.generate(headlab.load(str(tiny_folder)), PROMPT, policy=kv.Policy.parse("full:bits=4,group=4,residual=0"),
                         max_new_tokens=4, kv_dtype=torch.float16)
    assert half["kv_bytes"] == g.kv_bytes and half["ids"] == g.ids[0].tolist()
    assert half["kv_bytes_full"] * 2 == full["kv_bytes_full"] and half["kv_bytes"] < full["kv_bytes"]


def test_kv_from_an_atlas_keeps_the_non_local_heads_full(tiny_folder, tmp_path, capsys):
    atlas = tmp_path / "atlas.json"
    atlas.write_text(json.dumps({"scores": {"sink": [[0.0] * 4] * 2, "local": [[1, 1, 0.1, 1], [1, 1, 1, 1]]}}))
    code, out, err = run_cli(["generate", PROMPT, "--model", str(tiny_folder), "--kv-from", str(atlas), "--keep", "0.25",
                              "--policy", "streaming:1,2", "-n", "2", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["policy"]["heads"]["0.1"] == "full" and doc["heads"] == {"full": 1, "window": 3, "drop": 0}


@pytest.mark.parametrize("args, words", [
    (["--policy", "streaming:-1,4"], "negative"),
    (["--policy", "streaming:0,0"], "kv.drop"),
    (["--policy", "window"], "SINK,RECENT"),
    (["-n", "0"], "--max-new-tokens"),
    (["--keep", "2"], "--keep"),
    (["--kv-from", "/nonexistent/atlas.json"], "not a file"),
    (["--kv-dtype", "int8"], "--kv-dtype: unknown dtype 'int8'"),
])
def test_bad_options_exit_2_with_one_line_before_loading(args, words, capsys):
    code, out, err = run_cli(["generate", "hello", "--model", "/nonexistent/model", *args], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_a_policy_for_a_head_the_model_lacks_and_an_encoder_exit_2(tiny_folder, tmp_path, capsys):
    pol = tmp_path / "p.json"
    pol.write_text(json.dumps(kv.Policy.from_spec({(0, 5): "drop"}).to_json()))
    code, _, err = run_cli(["generate", PROMPT, "--model", str(tiny_folder), "--kv-from", str(pol)], capsys)
    assert code == 2 and "kv head 5 of layer 0" in err
    code, _, err = run_cli(["generate", "a sentence", "--model", "minilm"], capsys)
    assert code == 2 and "encoder-only" in err


def test_memory_predicts_the_cache_per_policy(capsys):
    code, out, err = run_cli(["memory", "-n", "8192", "--layers", "30", "--heads", "9", "--kv-heads", "3",
                              "--head-dim", "64", "--dtype", "float32", "--kv-policy", "streaming:4,256", "--json"], capsys)
    assert code == 0, err
    c = json.loads(out)["kv_cache"]
    assert c["full_bytes"] == 30 * 3 * 8192 * 2 * 64 * 4
    assert c["policy_bytes"] == policy_cache_bytes(kv.Policy.uniform(kv.window(4, 256)), kv_heads=[3] * 30,
                                                   tokens=8192, head_dim=64) == 30 * 3 * 260 * 2 * 64 * 4
    code, _, err = run_cli(["memory", "--layers", "2", "--kv-policy", "streaming:4"], capsys)
    assert code == 2 and "SINK,RECENT" in err


def test_sampling_options_act_with_sample_and_are_refused_without(tiny_folder, capsys):
    args = ["generate", PROMPT, "--model", str(tiny_folder), "-n", "3", "--json"]
    runs = []
    for _ in range(2):
        code, out, err = run_cli([*args, "--sample", "--temperature", "0.7", "--top-k", "3", "--seed", "5"], capsys)
        assert code == 0, err
        runs.append(json.loads(out)["ids"])
    assert runs[0] == runs[1]  # the seed is used
    code, _, err = run_cli([*args, "--temperature", "0.7"], capsys)
    assert code == 2 and "--temperature: it acts only on sampling; add --sample" in err
    code, out, err = run_cli([*args, "--model", str(tiny_folder), "-n", "64"], capsys)
    assert code == 2 and "--max-new-tokens 64: with the prompt it must fit in the 64 positions" in err


def test_kv_policy_takes_the_quantized_rules_in_generate_and_memory(tiny_folder, capsys):
    """``--kv-policy full:bits=4`` (the issue's name for ``--policy``): generate holds the bytes the cost model
    predicts for KIVI 4-bit heads and equals the library call; memory predicts the same rule at any length."""
    code, out, err = run_cli(["generate", PROMPT, "--model", str(tiny_folder), "--kv-policy",
                              "full:bits=4,group=4,residual=4", "-n", "3", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    rule = kv.full(bits=4, group=4, residual=4)
    g = headlab.generate(headlab.load(str(tiny_folder)), PROMPT, policy=kv.Policy.uniform(rule), max_new_tokens=3)
    held = doc["prompt_tokens"] + len(doc["ids"]) - 1
    assert doc["ids"] == g.ids[0].tolist() and doc["kv_bytes"] == g.kv_bytes
    assert doc["kv_bytes"] == policy_cache_bytes(kv.Policy.uniform(rule), kv_heads=[2, 2], tokens=held, head_dim=8)
    assert doc["kv_bytes"] < doc["kv_bytes_full"]
    code, out, err = run_cli(["memory", "-n", "4096", "--layers", "30", "--heads", "9", "--kv-heads", "3",
                              "--head-dim", "64", "--dtype", "float16", "--kv-policy", "full:bits=2", "--json"], capsys)
    assert code == 0, err
    c = json.loads(out)["kv_cache"]
    assert c["policy_bytes"] == policy_cache_bytes(kv.Policy.uniform(kv.full(bits=2)), kv_heads=[3] * 30,
                                                   tokens=4096, head_dim=64, dtype="float16") < c["full_bytes"] / 4
