"""The learned head split (DuoAttention's gates) and the passkey prompts it trains on."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

import headlab
from conftest import run_cli
from headlab import kv
from headlab.decode import passkey
from headlab.decode.cache import HeadCache
from headlab.decode.train import GateTraining, gated, train_gates
from headlab.errors import ConfigError, InputError
from headlab.models.loaded_model import resolve


class CharTok:
    """One token per character (codes below 128): every digit of a key is its own token."""

    bos_token_id = None

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = [ord(c) % 128 for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def decode(self, ids):
        return "".join(chr(int(i)) for i in ids)


TOK = CharTok()


def test_a_single_key_prompt_has_the_length_asked_and_the_needle_where_it_says():
    p = passkey.prompt(TOK, 900, [0.5], ["40718"])
    text = TOK.decode(p.ids[0])
    assert p.ids.shape == (1, 900) and p.answer == "40718"
    assert text[p.needle_at[0]:].startswith(" The pass key is 40718.")
    assert text.endswith("What is the pass key? The pass key is")
    assert TOK.decode(p.ids[0, -p.question:]) == "\nWhat is the pass key? The pass key is"
    before = text.index("40718") - len(passkey.INTRO)  # filler before the needle: half the filler, within a sentence
    filler = 900 - len(TOK(passkey.INTRO)["input_ids"]) - len(" The pass key is 40718. Remember it. 40718 is the pass "
                                                                 "key.") - len("\nWhat is the pass key? The pass key is")
    assert abs(before - len(" The pass key is ") - 0.5 * filler) <= 1


def test_a_multi_key_prompt_asks_for_one_label_and_orders_needles_by_depth():
    p = passkey.prompt(TOK, 1200, [0.8, 0.2, 0.5], ["11111", "22222", "33333"], labels=["red door", "blue box", "old clock"],
                       ask=0)
    text = TOK.decode(p.ids[0])
    assert p.answer == "11111" and text.endswith("What is the pass key for the red door? The pass key for the red door is")
    assert text.index("22222") < text.index("33333") < text.index("11111")
    assert all(text[at:].startswith(f" The pass key for the {lab} is {k}.")
               for at, lab, k in zip(p.needle_at, p.labels, p.keys))
    with pytest.raises(ConfigError, match="labels"):
        passkey.prompt(TOK, 500, [0.1, 0.2], ["11111", "22222"])
    with pytest.raises(InputError, match="no room"):
        passkey.prompt(TOK, 100, [0.5], ["11111"])
    with pytest.raises(ConfigError, match="depths"):
        passkey.prompt(TOK, 500, [1.5], ["11111"])


def test_answered_reads_the_first_five_digit_number():
    assert passkey.answered(" 40718. Remember", "40718")
    assert not passkey.answered(" 4071", "40718") and not passkey.answered(" 12345 40718", "40718")
    assert not passkey.answered(None, "40718")


def test_a_recital_marks_the_rows_that_predict_each_recited_digit():
    r = passkey.recital(TOK, 1500, 3, random.Random(1), far=300)
    ids = r.ids[0]
    predicted = "".join(TOK.decode([int(ids[i + 1])]) for i in r.positions.tolist())
    assert predicted.replace(" ", "") == "".join(r.keys) and r.ids.shape == (1, 1500)
    text = TOK.decode(ids)
    tail = text.index("Recite the pass keys.")
    assert all(tail - text.index(k) >= 300 for k in r.keys)  # every needle at least `far` before the recital
    assert passkey.filler("haystack", 0) != passkey.filler("haystack", 1)
    assert len(passkey.filler("haystack")) == 50 and passkey.filler()[0] == "The grass is green."


def _tiny(seed=0, H=4, Hkv=2, layers=2):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=layers, num_attention_heads=H, num_key_value_heads=Hkv,
        intermediate_size=64, attn_implementation="eager")).eval()


def test_gates_at_one_and_zero_equal_the_full_model_and_the_windowed_cache():
    lm = _tiny()
    ad = resolve(lm)[0]
    ids = torch.randint(0, 61, (1, 37))
    rule = kv.window(2, 6)
    with torch.no_grad():
        full = lm.model(input_ids=ids).last_hidden_state
        with gated(ad, torch.ones(2, 2), rule):
            ones = lm.model(input_ids=ids).last_hidden_state
        with gated(ad, torch.zeros(2, 2), rule):
            zeros = lm.model(input_ids=ids).last_hidden_state
        # the oracle: a prefill into headlab's per-head cache under the uniform window policy
        windowed = lm.model(input_ids=ids, cache=HeadCache(lm, kv.Policy.uniform(rule)), use_cache=True).last_hidden_state
        half = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
        with gated(ad, half, rule):
            mixed = lm.model(input_ids=ids).last_hidden_state
        spec = kv.Policy.from_spec({(0, 1): rule, (1, 0): rule})
        split = lm.model(input_ids=ids, cache=HeadCache(lm, spec), use_cache=True).last_hidden_state
    torch.testing.assert_close(ones, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(zeros, windowed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed, split, atol=1e-5, rtol=1e-5)
    assert (zeros - full).abs().max() > 1e-3  # the window matters on these 37 tokens


def test_training_finds_the_one_head_that_must_stay_full():
    lm = _tiny(seed=3, layers=2)
    with torch.no_grad():  # only kv head 0 of layer 1 writes to the stream: the others' gates cannot matter
        for layer, attn in enumerate(lm.model.layers):
            w = attn.self_attn.o_proj.weight  # (E, H * d), query heads 0-1 read kv head 0, 2-3 kv head 1
            keep = slice(0, 16) if layer == 1 else slice(0, 0)
            mask = torch.zeros_like(w)
            mask[:, keep] = 1
            w.mul_(mask)
            attn.self_attn.o_proj.weight.mul_(4.0)
    data = [(torch.randint(0, 61, (1, 48)), torch.arange(40, 47)) for _ in range(4)]
    t = train_gates(lm, data=data, rest=kv.window(1, 4), steps=40, lr=0.05, l1=0.01, progress=False)
    g = t.gates
    assert g[1, 0] > 0.8 and bool((g.flatten()[[0, 1, 3]] < 0.3).all()), g
    pol = kv.Policy.from_gates(lm, t, keep=0.25)
    assert pol.rule(1, 0) == kv.full and all(pol.rule(*k) == kv.window(1, 4) for k in [(0, 0), (0, 1), (1, 1)])
    assert pol.name == "trained split 25% full" and len(t.losses) == 40 and t.stopped == "steps"


def test_a_checkpoint_resumes_to_the_same_gates_and_a_time_budget_stops_early(tmp_path):
    lm = _tiny(seed=1)
    data = [(torch.randint(0, 61, (1, 30)), torch.arange(20, 29)) for _ in range(3)]
    straight = train_gates(lm, data=data, rest=kv.window(1, 4), steps=6, progress=False)
    ck = tmp_path / "gates.json"  # the runner's checkpoint: the run's JSON file with its finished steps
    first = train_gates(lm, data=data, rest=kv.window(1, 4), steps=4, checkpoint=ck, save_every=2, progress=False)
    assert first.steps == 4 and ck.is_file()
    resumed = train_gates(lm, data=data, rest=kv.window(1, 4), steps=6, checkpoint=ck, progress=False)
    assert resumed.steps == 6 and resumed.losses[:4] == first.losses
    torch.testing.assert_close(resumed.gates, straight.gates, atol=1e-6, rtol=0)
    with pytest.raises(InputError, match="other settings"):  # the runner's check of the kept units' settings
        train_gates(lm, data=data, rest=kv.window(1, 4), steps=6, lr=0.1, checkpoint=ck, progress=False)
    calls = []
    short = train_gates(lm, data=data, rest=kv.window(1, 4), steps=1000, seconds=0.05,
                        progress=lambda stage, done, total: calls.append((stage, done, total)))
    assert short.stopped == "seconds" and 1 <= short.steps < 1000 and calls[-1] == ("training gates", short.steps, 1000)
    assert calls[0] == ("training gates", 0, 1000)
    saved = short.save(tmp_path / "g.json")
    back = GateTraining.load(saved)
    assert torch.equal(back.gates, short.gates) and back.rest == kv.window(1, 4)
    assert all(p.requires_grad for p in lm.parameters())  # restored as they were


def test_training_leaves_the_weights_as_they_were():
    lm = _tiny(seed=2)
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    data = [(torch.randint(0, 61, (1, 30)), torch.arange(20, 29))]
    train_gates(lm, data=data, rest=kv.window(1, 4), steps=3, progress=False)
    assert all(torch.equal(before[k], v) for k, v in lm.state_dict().items())


@pytest.mark.parametrize("kwargs, words", [
    ({"rest": kv.window(1, 4, bits=4)}, "plain window"),
    ({"rest": "full"}, "plain window"),
    ({"steps": 0}, "steps"),
    ({"lr": 0.0}, "lr"),
    ({"seconds": -1}, "seconds"),
    ({"data": []}, "empty"),
])
def test_bad_training_options_are_refused(kwargs, words):
    lm = _tiny()
    opts = {"data": [(torch.randint(0, 61, (1, 30)), torch.arange(20, 29))], "rest": kv.window(1, 4),
            "progress": False, **kwargs}
    with pytest.raises((ConfigError, InputError), match=words):
        train_gates(lm, **opts)


def test_from_gates_reads_a_tensor_a_file_and_refuses_a_wrong_shape(tmp_path):
    lm = _tiny()
    g = torch.tensor([[0.1, 0.9], [0.8, 0.2]])
    pol = kv.Policy.from_gates(lm, g, keep=0.5)
    assert {k for k, r in pol.rules.items() if r == kv.full} == {(0, 1), (1, 0)}
    saved = GateTraining(g, kv.window(2, 5)).save(tmp_path / "g.json")
    again = kv.Policy.from_gates(lm, saved, keep=0.5)
    assert again.rules == {**pol.rules, **{k: kv.window(2, 5) for k in [(0, 0), (1, 1)]}}
    with pytest.raises(ConfigError, match="do not fit"):
        kv.Policy.from_gates(lm, torch.ones(3, 2), keep=0.5)
    with pytest.raises(InputError, match="not a gate file"):
        (tmp_path / "bad.json").write_text("{}")
        kv.Policy.from_gates(lm, tmp_path / "bad.json", keep=0.5)


def test_without_data_a_model_without_tokenizer_is_told_to_give_data():
    with pytest.raises(ConfigError, match="data="):
        train_gates(_tiny(), rest=kv.window(1, 4), progress=False)


def test_policy_train_and_the_cli_take_gates(tmp_path, capsys):
    from conftest import save_word_level

    words = ["<pad>", "<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "park", "and", "."]
    folder = save_word_level(tmp_path / "m", _tiny(), words)
    loaded = headlab.load(str(folder))
    data = [(torch.randint(2, 14, (1, 30)), torch.arange(20, 29))]
    pol = kv.Policy.train(loaded, keep=0.5, rest=kv.window(1, 4, bits=4), kept=kv.full(bits=4), data=data, steps=2,
                          progress=False)
    assert pol.counts(loaded.adapter.layer_kv_heads)["full"] == 2 and pol.default == kv.window(1, 4, bits=4)
    t = train_gates(loaded, data=data, rest=kv.window(1, 4), steps=2, progress=False)
    gates = t.save(tmp_path / "gates.json")
    code, out, err = run_cli(["generate", "the cat sat on the mat", "--model", str(folder), "--kv-from", str(gates),
                              "--keep", "0.25", "--policy", "streaming:1,2", "-n", "2", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    want = kv.Policy.from_gates(loaded, t, keep=0.25, rest=kv.window(1, 2))
    assert doc["heads"] == {"full": 1, "window": 3, "drop": 0}
    assert {k: v for k, v in doc["policy"]["heads"].items()} == want.to_json()["heads"]


def test_the_cli_trains_gates_resumes_them_and_refuses_bad_options_before_loading(tmp_path, capsys):
    from conftest import save_word_level

    words = ["<pad>", "<unk>", "the", "pass", "key", "for", "is", ".", "red", "door", "recite", "keys"]
    folder = save_word_level(tmp_path / "m", _tiny(), words)
    out = tmp_path / "gates.json"
    args = ["train-gates", "--model", str(folder), "--out", str(out), "--window", "1,8", "--tokens", "120", "--keys", "1",
            "--contexts", "2"]
    code, _, err = run_cli(args + ["--steps", "2"], capsys)
    assert code == 0, err
    first = GateTraining.load(out)
    assert first.steps == 2 and first.rest == kv.window(1, 8)
    code, _, err = run_cli(args + ["--steps", "3", "--force"], capsys)  # a fresh run: the same first two steps
    assert code == 0, err
    again = GateTraining.load(out)
    assert again.steps == 3 and again.losses[:2] == first.losses
    for bad, words_ in ((["--window", "4"], "SINK,RECENT"), (["--steps", "0"], "--steps"), (["--tokens", "10"], "--tokens"),
                        (["--lr", "-1"], "--lr")):
        code, _, err = run_cli(args + bad + ["--force"], capsys)
        assert code == 2 and words_ in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(args, capsys)  # --out exists
    assert code == 2 and "exists" in err
