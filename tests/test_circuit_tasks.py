"""The circuits room's task pairs on tiny models: shapes, equal lengths and masks, metrics against hand
computations on made-up logits, seeds, subsets and typed errors.

The tokenizers are word-level over the tasks' own words, saved beside a tiny random Llama (no download):
one splits numbers into digits (as SmolLM2 does: "1732" is "1" "7" "3" "2"), one into pairs of digits (as
GPT-2 writes years: "17" "32"). The oracles read the prompts back from their tokens, never from the builders.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers

import headlab
from headlab.errors import ConfigError, InputError, ModelError, ShapeError
from headlab.interpret.circuits import tasks as T
from headlab.models.transformer import Transformer, TransformerConfig

DIGITS = [str(d) for d in range(10)]
PAIRS = [f"{y:02d}" for y in range(100)]


def _words() -> list[str]:
    texts = T.BABA + [T.GREATER_THAN] + T.NAMES + T.PLACES + T.OBJECTS + T.NOUNS + T.CITIES + T.SEPARATORS
    words = []
    for t in texts:
        words += re.findall(r"\w+|[^\w\s]+", re.sub(r"\[\w+\]|\{\w+\}", " ", t))
    return list(dict.fromkeys(w for w in words if not w.isdigit()))


WORDS = ["<pad>", "<unk>"] + _words() + DIGITS + PAIRS


def _save(folder, model, split: str, drop=()):
    """``model`` with a word-level tokenizer over WORDS (minus ``drop``) that splits numbers into single
    digits (``split="digit"``) or pairs of digits (``"pair"``)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(WORDS) if w not in drop}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    numbers = pre_tokenizers.Digits(individual_digits=True) if split == "digit" else \
        pre_tokenizers.Split(Regex(r"\d\d"), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), numbers])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return headlab.load(str(folder))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                                   attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("tasks")
    return {"digit": _save(root / "digit", model, "digit"), "pair": _save(root / "pair", model, "pair"),
            "no5": _save(root / "no5", model, "digit", drop={"5"}),
            "nocity": _save(root / "nocity", model, "digit", drop=set(T.CITIES))}


def _real(pairs, b: int, which: str = "clean") -> list[str]:
    """The tokens of row ``b``, padding left out."""
    d = getattr(pairs, which)
    n = int(d["attention_mask"][b].sum())
    return d["input_ids"][b, :n].tolist()


def _logits(pairs, vocab: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*pairs.clean["input_ids"].shape, vocab, generator=g, dtype=torch.float64)


def _common(pairs, name: str, n: int):
    """What every task promises: n pairs, equal shapes and masks, every row corrupted, right padding."""
    a, b = pairs.clean, pairs.corrupted
    assert pairs.name == name and len(pairs) == n and len(pairs.template) == n
    assert a["input_ids"].shape == b["input_ids"].shape and a["input_ids"].dtype == torch.long
    assert torch.equal(a["attention_mask"], b["attention_mask"])
    assert all(not torch.equal(a["input_ids"][i], b["input_ids"][i]) for i in range(n))
    m = a["attention_mask"]
    assert torch.equal(m, m.cummin(-1).values)  # right-padded: ones, then zeros
    assert pairs.metric.__name__ and "\n" not in pairs.description


def test_ioi_pairs_and_metric(models):
    lm = models["digit"]
    tok = lm.tokenizer
    pairs = T.ioi(lm, 12, seed=1)
    _common(pairs, "ioi", 12)
    assert pairs.template == [i // 2 + (15 if i % 2 else 0) for i in range(12)]  # BABA k, then its ABBA twin
    names = set(tok.convert_tokens_to_ids(T.NAMES))
    logits = _logits(pairs, len(WORDS))
    want = []
    for b in range(12):
        clean, corrupt = _real(pairs, b), _real(pairs, b, "corrupted")
        said = [t for t in clean if t in names]
        io = [t for t in said if said.count(t) == 1]
        s = [t for t in said if said.count(t) == 2]
        assert len(said) == 3 and len(io) == 1 and len(set(s)) == 1
        others = [t for t in corrupt if t in names]  # ABC: three other names, all different, the rest unchanged
        assert len(set(others)) == 3 and not set(others) & set(said)
        assert [t for t in clean if t not in names] == [t for t in corrupt if t not in names]
        want.append(float(logits[b, len(clean) - 1, io[0]] - logits[b, len(clean) - 1, s[0]]))
    assert torch.allclose(pairs.metric(logits), torch.tensor(want, dtype=torch.float64))


def test_ioi_prompts_are_the_benchmarks_and_templates_choose(models):
    tok = models["digit"].tokenizer
    quads = T.ioi_prompts(tok, 4, seed=0)
    assert quads[0][0].startswith("Then, ") and quads[1][0].startswith("Then, " + quads[1][2] + " and ")
    pairs = T.ioi(models["digit"], 4, templates=[4, "After [B] and [A] went to the [PLACE], [B] said to"])
    assert pairs.template == [0, 2, 1, 3]  # BABA 0, ABBA 0, BABA 1, ABBA 1 (ids: BABA k, ABBA len + k)
    with pytest.raises(ConfigError, match="BABA"):
        T.ioi(models["digit"], 4, templates=["[A] and [B] went home"])


def test_greater_than_on_digits(models):
    lm = models["digit"]
    tok = lm.tokenizer
    pairs = T.greater_than(lm, 10, seed=2)
    _common(pairs, "greater-than", 10)
    digit = tok.convert_tokens_to_ids(DIGITS)
    year = tok.convert_tokens_to_ids("year")
    logits = _logits(pairs, len(WORDS))
    want = []
    for b in range(10):
        clean, corrupt = _real(pairs, b), _real(pairs, b, "corrupted")
        at = clean.index(year)
        yy = [digit.index(t) for t in clean[at + 3:at + 5]]  # "1" "7" Y Y
        assert 10 <= 10 * yy[0] + yy[1] <= 89 and [digit.index(t) for t in corrupt[at + 3:at + 5]] == [0, 1]
        assert clean[-2:] == digit[1:2] + digit[7:8]  # the prompt ends with the century
        p = logits[b, len(clean) - 1].softmax(-1)
        want.append(sum(float(p[digit[t]]) * (1 if t > yy[0] else -1) for t in range(10) if t != yy[0]))
    assert torch.allclose(pairs.metric(logits).double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert pairs.template == [T.NOUNS.index(tok.convert_ids_to_tokens(_real(pairs, b)[1])) for b in range(10)]


def test_greater_than_on_two_digit_tokens(models):
    lm = models["pair"]
    tok = lm.tokenizer
    pairs = T.greater_than(lm, 8, seed=2)
    _common(pairs, "greater-than", 8)
    years = tok.convert_tokens_to_ids(PAIRS)
    logits = _logits(pairs, len(WORDS))
    want = []
    for b in range(8):
        clean = _real(pairs, b)
        yy = years.index(clean[clean.index(tok.convert_tokens_to_ids("year")) + 2])  # "17" YY
        assert 2 <= yy <= 98
        p = logits[b, len(clean) - 1].softmax(-1)  # Hanna et al.: sum_{y > YY} p(y) - sum_{y <= YY} p(y)
        want.append(sum(float(p[years[y]]) for y in range(yy + 1, 100)) - sum(float(p[years[y]]) for y in range(yy + 1)))
    assert torch.allclose(pairs.metric(logits).double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)


def test_retrieval_pairs_and_metric(models):
    lm = models["digit"]
    tok = lm.tokenizer
    pairs = T.retrieval(lm, 9, seed=4)
    _common(pairs, "retrieval", 9)
    assert pairs.template == [i % 3 for i in range(9)]
    names, cities = set(tok.convert_tokens_to_ids(T.NAMES)), set(tok.convert_tokens_to_ids(T.CITIES))
    logits = _logits(pairs, len(WORDS))
    want = []
    for b in range(9):
        clean, corrupt = _real(pairs, b), _real(pairs, b, "corrupted")
        value = {k: v for k, v in zip(clean, clean[1:]) if k in names and v in cities}  # "key value" facts
        assert len(value) == 3 and clean[:-1] == corrupt[:-1] and clean[-1] in value and corrupt[-1] in value
        want.append(float(logits[b, len(clean) - 1, value[clean[-1]]] - logits[b, len(clean) - 1, value[corrupt[-1]]]))
    assert torch.allclose(pairs.metric(logits), torch.tensor(want, dtype=torch.float64))


def _bare(vocab=40):
    torch.manual_seed(0)
    return Transformer(TransformerConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, causal=True)).eval()


def test_induction_on_a_bare_model():
    m, half = _bare(), 6
    pairs = T.induction(m, 5, half=half, vocab=40, seed=3)
    _common(pairs, "induction", 5)
    a, b = pairs.clean["input_ids"], pairs.corrupted["input_ids"]
    assert a.shape == (5, 2 * half) and torch.equal(a[:, :half], a[:, half:]) and torch.equal(b[:, half:], a[:, half:])
    assert all(not set(b[i, :half].tolist()) & set(a[i, :half].tolist()) for i in range(5))  # nothing to copy
    logits = _logits(pairs, 40)
    want = [sum(float(logits[i, half + j].log_softmax(-1)[a[i, half + j + 1]]) for j in range(half - 1)) / (half - 1)
            for i in range(5)]
    assert torch.allclose(pairs.metric(logits), torch.tensor(want, dtype=torch.float64))
    with torch.no_grad():  # and on the model's own logits
        assert pairs.metric(m(a).logits).shape == (5,)
    assert torch.equal(T.induction(m, 5, half=half, seed=3).clean["input_ids"], a)  # vocab read from the embedding


def test_induction_on_a_loaded_model_draws_no_special_token(models):
    pairs = T.induction(models["digit"], 4, half=5)
    assert pairs.clean["input_ids"].shape == (4, 10) and int(pairs.clean["input_ids"].min()) >= 2
    assert int(pairs.corrupted["input_ids"].min()) >= 2 and int(pairs.clean["input_ids"].max()) < len(WORDS)


def test_seeds_subset_and_registry(models):
    lm = models["digit"]
    for name in T.TASKS:
        one, two = T.task(name, lm, 6, seed=5), T.task(name, lm, 6, seed=5)
        assert torch.equal(one.clean["input_ids"], two.clean["input_ids"])
        assert torch.equal(one.corrupted["input_ids"], two.corrupted["input_ids"]) and one.template == two.template
        assert not torch.equal(T.task(name, lm, 6, seed=6).clean["input_ids"], one.clean["input_ids"])
        logits = _logits(one, len(WORDS))
        sub = one.subset([4, 1, 4])
        assert len(sub) == 3 and sub.template == [one.template[i] for i in (4, 1, 4)]
        assert torch.equal(sub.clean["input_ids"], one.clean["input_ids"][[4, 1, 4]])
        assert torch.allclose(sub.metric(logits[[4, 1, 4]]), one.metric(logits)[[4, 1, 4]])
    with pytest.raises(ConfigError, match="0..5"):
        one.subset([6])
    with pytest.raises(ShapeError, match="TaskPairs.subset"):
        one.metric(logits[:2])  # a metric of 6 pairs refuses the logits of 2


def test_runs_under_patch(models):
    lm = models["digit"]
    pairs = T.retrieval(lm, 3)
    res = headlab.patch(lm, pairs.clean, pairs.corrupted, pairs.metric, sites="z")
    with torch.no_grad():
        want = float(pairs.metric(lm.adapter.forward(pairs.clean).logits).mean())
    assert res.metric == "logit_diff" and res.clean == pytest.approx(want, abs=1e-5)


def test_typed_errors(models):
    lm = models["digit"]
    for bad in (0, -2, 2.5, True, "4"):
        for name in ("ioi", "induction"):
            with pytest.raises(ConfigError, match="positive int"):
                T.task(name, lm, bad)
    for name in ("ioi", "greater-than", "induction", "retrieval"):  # refused before a prompt is drawn
        with pytest.raises(ConfigError, match="at most 10,000"):
            T.task(name, lm, 10**9)
    with pytest.raises(ConfigError, match="ioi, greater-than, induction, retrieval"):
        T.task("docstring", lm)
    with pytest.raises(ConfigError, match="half"):
        T.task("ioi", lm, 4, half=3)
    with pytest.raises(ConfigError, match="at least 2"):
        T.induction(lm, 4, half=1)
    with pytest.raises(ModelError, match="tokenizer"):
        T.ioi(_bare(), 4)
    with pytest.raises(InputError, match="'5'"):
        T.greater_than(models["no5"], 4)
    with pytest.raises(InputError, match="cities"):
        T.retrieval(models["nocity"], 4)
    with pytest.raises(InputError, match="vocab=99"):
        T.induction(_bare(), 4, vocab=99)
