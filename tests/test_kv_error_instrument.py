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


def layers(path, n_tasks: int, tokens: int, answers=None):
    """For each suite task (seed 0) and layer of the tiny model: ``q`` and the float16 ``k``, ``v`` of the context
    and question (and ``answers[i]`` but its last token, when given; hooks on the projections, transformers' own
    RoPE), the context's length, and the attention output at the question's queries (or, with ``answers``, at those
    that decode the answer: from the question's last on) for given keys and values (torch's SDPA, causal,
    ``attn_mask`` ANDed with it)."""
    import headlab
    from headlab.decode import suite
    from headlab.models.loaded_model import resolve
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lm = headlab.load(str(path))
    model, tok = resolve(lm)[0].model, lm.tokenizer
    for i, t in enumerate(suite.make_suite(tok, n_tasks, tokens=tokens, seed=0)):
        c, qn = (tok(x, add_special_tokens=False)["input_ids"] for x in (t.context, t.question))
        ids = torch.tensor([c + qn + (answers[i][:-1] if answers else [])])
        n, m = ids.shape[1], len(c)
        first = m + len(qn) - 1 if answers else m
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

            def out_(kk, vv, gone=None, q=q, n=n, first=first):  # gone (h_kv, n): keys evicted from a kv head
                mask = (torch.arange(n)[None] <= torch.arange(n)[:, None])[None, None]
                if gone is not None:
                    mask = mask & ~gone.repeat_interleave(2, 0)[None, :, None, :]
                o = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, enable_gqa=True, attn_mask=mask)
                return o[:, :, first:]

            yield q, k.half(), v.half(), m, out_


def test_the_errors_are_the_definitions_computed_apart(tiny):
    from headlab.interpret.study import runner

    out = runner.run("kv-error", {"model": str(tiny), "n": 2, "tokens": 128, "seed": 0, "bits": 4, "group": 8})
    f = out.result.figures
    rows = {r["variant"]: r for r in f["rows"]}
    assert f["tasks"] == 2 and f["pre_rope"] and "values rotated" in rows and "keys before RoPE" in rows
    got: dict[str, list[float]] = {"kivi": [], "values only": [], "8 bits": [], "keys g*2": [], "keys per token": []}
    for q, k16, v16, m, out_ in layers(tiny, 2, 128):
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
                                         (["--at", "context"], "--at 'context': give question or answer"),
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


def snapkv_top(q, k, first: int, last: int, count: int, pool: int) -> torch.Tensor:
    """(h_kv, first) bool: per kv head, the ``count`` keys before ``first`` that the queries ``first..last-1``
    attend to most (SnapKV's votes: softmax rows summed, max over ``pool`` neighbours, mean over the 2 query heads
    of a kv head), ties to the earlier position; written with numpy's stable argsort."""
    import numpy as np

    a = torch.softmax((q[0, :, first:last] @ k[0, :, :last].float().repeat_interleave(2, 0).transpose(1, 2))
                      / 4.0 + torch.triu(torch.full((last - first, last), float("-inf")), first + 1), -1)
    votes = a[:, :, :first].sum(1)  # (H, first)
    r = pool // 2
    padded = torch.nn.functional.pad(votes, (r, r), value=float("-inf"))
    votes = torch.stack([padded[:, j:j + first] for j in range(pool)]).amax(0).view(2, 2, first).mean(1)
    sel = torch.zeros(2, first, dtype=torch.bool)
    for h in range(2):
        sel[h, np.argsort(-votes[h].numpy(), kind="stable")[:count]] = True
    return sel


def held(kc, vc, parts):
    """Keys and values ``(1, 2, t, d)`` with each kv head's tokens of a part ``(chosen (2, t), bits)``, in order of
    position, quantized as one sequence (groups of 8); tokens in no part left at 0."""
    kq, vq = torch.zeros(kc.shape), torch.zeros(vc.shape)
    for h in range(2):
        for sel, bits in parts:
            i = sel[h].nonzero()[:, 0]
            kq[:, h, i] = keys(kc[:, h:h + 1, i], bits, 8)[:, 0]
            vq[:, h, i] = values(vc[:, h:h + 1, i], bits, 8)[:, 0]
    return kq, vq


def uneven(q, k16, v16, m: int, q_end: int):
    """The three rows at 4 bits' bytes (groups of 8), as ``(name, (keys, values), evicted (2, n) or None)``: the
    third at 8 bits chosen by SnapKV's votes of the context's last 32 queries (the 32 among them) or by the
    question's queries ``m..q_end-1``, and SnapKV's top two thirds at 8 bits with the rest evicted."""
    kc, vc = k16[:, :, :m], v16[:, :, :m]
    window = torch.ones(2, 32, dtype=torch.bool)
    agnostic = torch.cat([snapkv_top(q, k16, m - 32, m, round(m / 3) - 32, 7), window], 1)
    oracle = snapkv_top(q, k16, m, q_end, round(m / 3), 1)
    kept = torch.cat([snapkv_top(q, k16, m - 32, m, round(m * 8 / 12) - 32, 7), window], 1)
    gone = torch.cat([~kept, torch.zeros(2, k16.shape[2] - m, dtype=torch.bool)], 1)
    return [("8/2 bits by SnapKV's score", held(kc, vc, [(agnostic, 8), (~agnostic, 2)]), None),
            ("8/2 bits by the question's attention", held(kc, vc, [(oracle, 8), (~oracle, 2)]), None),
            ("8 bits on SnapKV's top, rest evicted", held(kc, vc, [(kept, 8)]), gone)]


def test_mixed_precision_at_4_bits_bytes_is_its_definition(tiny):
    """A third of the context at 8 bits and the rest at 2, the third chosen by SnapKV's votes of the context's last
    32 queries (the 32 among them) or by the question's own attention; and 8 bits on SnapKV's top two thirds (the
    bytes of 4 bits at groups of 8: (4 + 4) / (8 + 4)), the rest evicted. Each kv head's chosen tokens are
    quantized as one sequence, in order of position."""
    from headlab.interpret.study import runner

    out = runner.run("kv-error", {"model": str(tiny), "n": 2, "tokens": 256, "seed": 0, "bits": 4, "group": 8})
    rows = {r["variant"]: r for r in out.result.figures["rows"]}
    got: dict[str, list[float]] = {"8/2 bits by SnapKV's score": [], "8/2 bits by the question's attention": [],
                                   "8 bits on SnapKV's top, rest evicted": []}

    for q, k16, v16, m, out_ in layers(tiny, 2, 256):
        assert m / 3 > 32  # the third holds more than the window
        ref = out_(k16.float(), v16.float())
        kt, vt = k16[:, :, m:].float(), v16[:, :, m:].float()
        for name, (kk, vv), g in uneven(q, k16, v16, m, q.shape[2]):
            o = out_(torch.cat([kk, kt], 2), torch.cat([vv, vt], 2), g)
            got[name].append(float((o - ref).norm() / ref.norm()))
    for name, errs in got.items():
        assert rows[name]["rel_error"] == pytest.approx(sum(errs) / len(errs), rel=1e-3), name
    assert rows["8/2 bits by the question's attention"]["rel_error"] != rows["8/2 bits by SnapKV's score"]["rel_error"]


def test_at_the_answer_the_error_is_read_where_the_answer_is_decoded(tiny):
    """``--at answer``: the answer is the model's greedy one (each token the argmax after the tokens before it, up
    to the task's ``max_new_tokens``), and the errors are read at the queries that decode it, the third of the
    oracle row still chosen by the question's own queries."""
    import headlab
    from headlab.decode import suite
    from headlab.interpret.study import runner

    out = runner.run("kv-error", {"model": str(tiny), "n": 2, "tokens": 256, "seed": 0, "bits": 4, "group": 8,
                                  "at": "answer"})
    rows = {r["variant"]: r for r in out.result.figures["rows"]}
    answers = out.ctx.state["answers"]
    lm = headlab.load(str(tiny))
    tasks = suite.make_suite(lm.tokenizer, 2, tokens=256, seed=0)
    for i, t in enumerate(tasks):
        prompt = [tok for x in (t.context, t.question) for tok in lm.tokenizer(x, add_special_tokens=False)["input_ids"]]
        a = answers[i]
        assert 1 <= len(a) <= t.max_new_tokens
        with torch.no_grad():
            logits = lm.model(torch.tensor([prompt + a])).logits[0]
        assert logits[len(prompt) - 1:len(prompt) + len(a) - 1].argmax(-1).tolist() == a
    got: dict[str, list[float]] = {"kivi": [], "8/2 bits by SnapKV's score": [],
                                   "8/2 bits by the question's attention": [], "8 bits on SnapKV's top, rest evicted": []}
    qlens = [len(lm.tokenizer(t.question, add_special_tokens=False)["input_ids"]) for t in tasks]

    for j, (q, k16, v16, m, out_) in enumerate(layers(tiny, 2, 256, answers)):
        ref = out_(k16.float(), v16.float())
        kc, vc, kt, vt = k16[:, :, :m], v16[:, :, :m], k16[:, :, m:].float(), v16[:, :, m:].float()
        kivi = ("kivi", (keys(kc, 4, 8), values(vc, 4, 8)), None)
        for name, (kk, vv), g in [kivi, *uneven(q, k16, v16, m, m + qlens[j // 2])]:
            o = out_(torch.cat([kk, kt], 2), torch.cat([vv, vt], 2), g)
            got[name].append(float((o - ref).norm() / ref.norm()))
    for name, errs in got.items():
        assert rows[name]["rel_error"] == pytest.approx(sum(errs) / len(errs), rel=1e-3), name
