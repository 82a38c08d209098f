"""The RULER-style suite (issue 42, item 4): each task's answers are recoverable from its prompt by an independent
reading of the text, the suite is deterministic from its seed, the paired statistics equal hand computations, and
perplexity on decoded tokens equals a forward's cross-entropy (full cache) and what ``perplexity(prefill=)`` adds up
to (a quantized cache)."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from headlab import kv
from headlab.decode import perplexity, suite
from headlab.decode.suite_stats import decoded_nll, mcnemar, paired_bootstrap
from headlab.errors import ConfigError, InputError


def recovered(t: suite.Task) -> set[str]:
    """The answers, read from the prompt alone."""
    text, q = t.context, t.question
    if t.kind.startswith("niah"):
        key = re.search(r"numbers? for the (.+?) mentioned", q).group(1)
        return set(re.findall(rf"special magic numbers for the {key} is: (\d+)\.", text))
    if t.kind == "variable_tracking":
        value = re.search(r"assigned the value (\d+) in", q).group(1)
        held = {a for a, b in re.findall(r"VAR ([A-Z]+) = (\d+)\.", text) if b == value}
        pairs = re.findall(r"VAR ([A-Z]+) = VAR ([A-Z]+)\.", text)
        while True:
            more = {a for a, b in pairs if b in held} - held
            if not more:
                return held
            held |= more
    if t.kind == "common_words":
        top = int(re.search(r"What are the (\d+) most", q).group(1))
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", text)).most_common()
        assert counts[top - 1][1] > counts[top][1]  # the top words are unambiguous
        return {w for w, _ in counts[:top]}
    name = re.search(r"does (.+?) live\?", q).group(1)
    return set(re.findall(rf"{name} moved to (.+?) many years ago", text))


@pytest.mark.parametrize("tokens", [300, 900])
def test_every_answer_is_recoverable_from_its_prompt_and_the_suite_is_deterministic(tokens):
    tasks = suite.make_suite(None, 18, tokens=tokens, seed=5)
    assert [t.kind for t in tasks[:6]] == list(suite.KINDS)
    for t in tasks:
        assert recovered(t) == set(t.answers), t.kind
        assert t.score(" ".join(t.answers)) == 1.0 and t.correct(", ".join(t.answers)) and not t.correct("")
        n = len((t.context + t.question).split())
        assert 0.7 * tokens <= n <= 1.3 * tokens, (t.kind, n)  # lengths counted in words without a tokenizer
        held_out = suite.haystack()[-suite.HELD_OUT:]
        assert not any(s in t.context for s in held_out) and any(s in t.continuation for s in held_out)
    assert suite.make_suite(None, 18, tokens=tokens, seed=5) == tasks
    assert [t.answers for t in suite.make_suite(None, 18, tokens=tokens, seed=6)] != [t.answers for t in tasks]
    mv = next(t for t in tasks if t.kind == "niah_multivalue")
    assert mv.score(mv.answers[0] + " and " + mv.answers[2]) == 0.5
    assert not mv.correct(mv.answers[0][:-1])  # a number is matched whole


def test_bad_suite_arguments_are_refused():
    for bad in ({"kinds": ["haystack"]}, {"tokens": 10}):
        with pytest.raises(ConfigError):
            suite.make_suite(None, 2, **bad)


def test_mcnemar_and_its_paired_interval_equal_a_hand_computation():
    # 20 prompts: 10 right under both, 6 right under a only, 2 under b only, 2 wrong under both
    a = [1] * 10 + [1] * 6 + [0] * 2 + [0] * 2
    b = [1] * 10 + [0] * 6 + [1] * 2 + [0] * 2
    r = mcnemar(a, b)
    assert (r.n, r.n10, r.n01) == (20, 6, 2) and r.diff == pytest.approx(0.2)
    se = math.sqrt(8 - 16 / 20) / 20  # sqrt(n10 + n01 - (n10 - n01)^2 / n) / n
    assert (r.low, r.high) == pytest.approx((0.2 - 1.959964 * se, 0.2 + 1.959964 * se), abs=1e-6)
    assert r.p_value == pytest.approx(2 * (1 + 8 + 28) / 2**8)  # two-sided binomial, 2 of 8 discordant
    assert mcnemar([1, 0], [1, 0]).p_value == 1.0 and mcnemar([1, 0], [1, 0]).high == 0.0
    with pytest.raises(InputError):
        mcnemar([1, 0, 1], [1, 0])
    with pytest.raises(InputError):
        mcnemar([0.5], [1])


def test_the_paired_bootstrap_interval_matches_the_normal_one_and_keeps_the_pairs():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(400, generator=g, dtype=torch.float64)
    a, b = base + 0.1 + 0.2 * torch.randn(400, generator=g, dtype=torch.float64), base
    r = paired_bootstrap(a, b, resamples=20_000, seed=1)
    d = (a - b)
    se = d.std(unbiased=False).item() / math.sqrt(400)  # the bootstrap's standard error of the mean
    assert r.diff == pytest.approx(d.mean().item())
    assert r.low == pytest.approx(d.mean().item() - 1.96 * se, abs=0.1 * se)
    assert r.high == pytest.approx(d.mean().item() + 1.96 * se, abs=0.1 * se)
    assert r.high - r.low < 0.2  # paired: the shared base (sd 1) does not widen it
    assert paired_bootstrap([2.0] * 5, [1.0] * 5) .low == 1.0


def _lm():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64,
                                        attn_implementation="eager")).eval()


def test_perplexity_on_decoded_tokens():
    lm = _lm()
    ids = torch.randint(0, 61, (1, 70))
    n = 50
    full = decoded_nll(lm, ids[:, :n], ids[:, n:])
    lm.set_attn_implementation("eager")
    with torch.no_grad():
        logits = lm(input_ids=ids).logits[0].double()
    want = torch.nn.functional.cross_entropy(logits[n - 1 : -1], ids[0, n:], reduction="none")
    torch.testing.assert_close(full, want, rtol=1e-4, atol=1e-4)
    q4 = kv.Policy.parse("full:bits=4,group=8,residual=16")
    dec = decoded_nll(lm, ids[:, :n], ids[:, n:], policy=q4)
    total = want.new_tensor(torch.nn.functional.cross_entropy(logits[: n - 1], ids[0, 1:n], reduction="sum").item())
    ppl = perplexity(lm, ids, policy=q4, prefill=n)  # the prefill's positions in full precision, then decoded
    assert math.log(ppl) * 69 == pytest.approx((total + dec.sum()).item(), rel=1e-4)
    assert not torch.allclose(dec, full, atol=1e-6)  # the decoded tokens do see the 4-bit cache
