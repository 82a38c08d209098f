"""``headlab kv error``: the relative error of each layer's attention output when the context's keys and values are
quantized, as an instrument of the study runner.

The reference below is written from the definitions, not from headlab: the queries, keys and values come from
forward hooks on the Llama projections and transformers' own ``apply_rotary_pos_emb``, attention is torch's
``scaled_dot_product_attention``, and KIVI's min-max groups are quantized here (keys per channel over tokens,
values per token over channels; scale and zero rounded to float16 first)."""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import run_cli, save_word_level
from test_kv_suite_instrument import WORDS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=512, attention_bias=True, attn_implementation="eager")).eval()
    return save_word_level(tmp_path_factory.mktemp("tiny-error"), model, WORDS)


def minmax(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """``x`` (float16) read back after min-max groups along ``dim``: scale, zero in float16, codes from them."""
    lo, hi = x.float().amin(dim, keepdim=True), x.float().amax(dim, keepdim=True)
    scale, zero = ((hi - lo) / (2**bits - 1)).half().float(), lo.half().float()
    codes = ((x.float() - zero) / scale.where(scale > 0, torch.ones_like(scale))).round().clamp(0, 2**bits - 1)
    return (codes * scale + zero).half().float()


def keys(k, bits, group):  # (1, h, t, d): whole groups of tokens per channel, a last partial group exact
    w = k.shape[2] // group * group
    held = minmax(k[:, :, :w].unflatten(2, (-1, group)), 3, bits).flatten(2, 3)
    return torch.cat([held, k[:, :, w:].float()], 2)


def values(v, bits, group):  # per token, groups of channels
    return minmax(v.unflatten(3, (-1, group)), 4, bits).flatten(3)


def test_the_errors_are_the_definitions_computed_apart(tiny):
    import headlab
    from headlab.decode import suite
    from headlab.interpret.study import runner
    from headlab.models.loaded_model import resolve
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    out = runner.run("kv-error", {"model": str(tiny), "n": 2, "tokens": 128, "seed": 0, "bits": 4, "group": 8})
    f = out.result.figures
    rows = {r["variant"]: r for r in f["rows"]}
    assert f["tasks"] == 2 and f["pre_rope"] and "values rotated" in rows and "keys before RoPE" in rows
    lm = headlab.load(str(tiny))
    model, tok = resolve(lm)[0].model, lm.tokenizer
    got: dict[str, list[float]] = {"kivi": [], "values only": [], "8 bits": [], "keys g*2": [], "keys per token": []}
    for t in suite.make_suite(tok, 2, tokens=128, seed=0):
        c = tok(t.context, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([c + tok(t.question, add_special_tokens=False)["input_ids"]])
        n, m = ids.shape[1], len(c)
        seen: dict = {}
        hooks = [getattr(layer.self_attn, p).register_forward_hook(
                 lambda mod, i, o, key=(li, p): seen.__setitem__(key, o.detach()))
                 for li, layer in enumerate(model.model.layers) for p in ("q_proj", "k_proj", "v_proj")]
        with torch.no_grad():
            model(ids)
        for h in hooks:
            h.remove()
        cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(n)[None])
        for li in range(2):
            q, k, v = (seen[li, p].view(1, n, -1, 16).transpose(1, 2) for p in ("q_proj", "k_proj", "v_proj"))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k16, v16 = k.half(), v.half()

            def out_(kk, vv):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, kk, vv, is_causal=False, enable_gqa=True,
                    attn_mask=torch.arange(n)[None] <= torch.arange(n)[:, None])
                return o[:, :, m:]

            ref = out_(k16.float(), v16.float())
            kc, vc, kt, vt = k16[:, :, :m], v16[:, :, :m], k16[:, :, m:].float(), v16[:, :, m:].float()
            for name, (kk, vv) in {"kivi": (keys(kc, 4, 8), values(vc, 4, 8)),
                                   "values only": (kc.float(), values(vc, 4, 8)),
                                   "8 bits": (keys(kc, 8, 8), values(vc, 8, 8)),
                                   "keys g*2": (keys(kc, 4, 16), values(vc, 4, 8)),
                                   "keys per token": (values(kc, 4, 8), values(vc, 4, 8))}.items():
                o = out_(torch.cat([kk, kt], 2), torch.cat([vv, vt], 2))
                got[name].append(float((o - ref).norm() / ref.norm()))
    for name, errs in got.items():
        assert rows[name]["rel_error"] == pytest.approx(sum(errs) / len(errs), rel=1e-3), name
    assert rows["8 bits"]["rel_error"] < rows["kivi"]["rel_error"] / 5
    assert 0 < f["top5_share"] <= 1 and len(f["head_error"]) == 2 and len(f["head_error"][0]) == 2


@pytest.mark.parametrize("argv, words", [(["--bits", "3"], "--bits 3: give 2, 4 or 8"),
                                         (["--group", "48"], "--group 48: give a power of 2"),
                                         (["--tokens", "9000"], "must fit in the 8,192 positions of smollm2"),
                                         (["--n", "1000000"], "at most 100,000 tasks")])
def test_bad_quantizers_are_refused_before_the_load(argv, words, tmp_path, no_load, capsys):
    code, _, err = run_cli(["kv", "error", *argv, "--out", str(tmp_path / "e.json")], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_the_command_prints_the_table_and_writes_the_result(tiny, tmp_path, capsys):
    import json

    code, out, err = run_cli(["kv", "error", "--model", str(tiny), "--n", "1", "--tokens", "128", "--group", "8",
                              "-o", str(tmp_path / "e.json")], capsys)
    doc = json.loads((tmp_path / "e.json").read_text())
    assert code == 0 and doc["headlab"]["kind"] == "kv_error" and doc["tasks"] == 1, err
    assert "| kivi | " in out and "| 8 bits | " in out and "five worst of the 4 kv heads" in out, out
