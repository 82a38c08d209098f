"""Adding an atlas kind is one record and its registration: a toy kind registered here is scored (against
explicit attention maps), checked, kept in the JSON, drawn on the atlas page and listed by the report's atlas
section, without changing any other kind's numbers; unregistered, it leaves no trace."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import headlab
from headlab.errors import ConfigError
from headlab.interpret.atlas import KINDS, ROLE, Atlas, Kind, Thresholds, atlas, register, unregister
from headlab.interpret.atlas import scores as S
from headlab.interpret.atlas import tasks as T
from headlab.interpret.atlas.kinds.shared import REPEATED_LOSS, repeated_grid
from headlab.interpret.atlas.page import render_page

RUN = dict(texts=[[(7 * i) % 45 + 1 for i in range(150)]], k=2, n_draws=3, half=6, n_repeated=3, max_tokens=24,
           n_texts=3, needle_trials=2, haystack_tokens=30, n_boot=50)


def _self_score(run):
    """The toy kind's score: the mean weight a row puts on its own token, ``A[i, i]``, on the repeated tokens."""
    return repeated_grid(run, lambda q, k, ca, lse: S.offset_mass(q, k, ca, 0, lse).mean(-1))


TOY = Kind(name="self_token", role="self-attending", threshold=0.3, score=_self_score, reads="repeated",
           task=REPEATED_LOSS, letter="Z", colour="#17becf",
           definition="mean weight on the query's own token, A[i, i], on random tokens repeated once")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                                   attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def plain(model):
    """The atlas before the toy kind is registered."""
    return atlas(model, **RUN)


@pytest.fixture
def toy(plain):
    kind = register(TOY)
    yield kind
    unregister(kind.name)


def test_a_registered_kind_reaches_scores_checks_json_and_pages(model, plain, toy):
    from headlab.interpret.report.sections.atlas import AtlasSection, _kinds

    a = atlas(model, **RUN)
    assert a.kinds == plain.kinds + ["self_token"] and a.thresholds["self_token"] == 0.3
    # the score against explicit maps of the same repeated sequences
    ids, _ = T.repeated(None, vocab=48, n=RUN["n_repeated"], half=RUN["half"], seed=0)
    maps = headlab.capture(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                           "blocks.*.attn.pattern").stack("pattern").double()  # (layers, B, H, n, n)
    want = maps.diagonal(dim1=-2, dim2=-1).mean(-1).mean(1)  # (layers, H)
    assert torch.allclose(a.scores["self_token"], want, atol=2e-5)
    # checked on the task it names, beside the kinds that share it; every other kind's numbers unchanged
    v = a.verdicts["self_token"]
    assert v["task"] == "loss on the repeated half" and v["heads"] == [list(x) for x in a.top("self_token", 2)]
    assert len(v["effects"]["random"]) == RUN["n_draws"] and v["verdict"] in ("causal", "not confirmed")
    for kind in plain.kinds:
        assert torch.equal(a.scores[kind].nan_to_num(-1), plain.scores[kind].nan_to_num(-1)), kind
    assert {kd: plain.verdicts[kd]["effects"] for kd in plain.verdicts} == \
        {kd: a.verdicts[kd]["effects"] for kd in plain.verdicts}
    assert any(key.startswith("self_token:") for key in a.evidence)  # its top heads' maps, on the repeated tokens
    # the JSON, and back
    data = json.loads(json.dumps(a.to_json()))
    assert data["summary"]["self_token"]["threshold"] == 0.3 and "self_token" in data["verdicts"]
    back = Atlas.from_json(json.dumps(data))
    assert torch.allclose(back.scores["self_token"], a.scores["self_token"].double(), atol=1e-6)
    assert back.recheck("self_token")["verdict"] == v["verdict"]
    # the atlas page: its heatmap, its legend, its verdict row, its letter in a head's cell
    page = render_page(a)
    assert 'data-grid="self_token"' in page and "Z self-attending</span>" in page
    assert '<tr data-kind="self_token"><td>self-attending</td>' in page
    planted = Atlas.from_json(data)
    planted.scores["self_token"][1, 3] = 0.99
    assert "self-attending" in planted.roles(1, 3)
    assert 'data-l="1" data-h="3" title="1.3: ' in render_page(planted)
    assert ROLE["self_token"] == "self-attending" and Thresholds(self_token=0.9).as_dict()["self_token"] == 0.9
    # the analyze report's atlas section runs it (it reads the repeated tokens) and lists its heads
    assert "self_token" in _kinds(None)
    part = AtlasSection().page(None, a, {}).html
    assert f"<tr><td>self-attending</td><td>&ge; 0.3</td><td>{a.summary()['self_token']['count']} " in part


def test_the_registry_refuses_what_it_cannot_hold(model, toy):
    with pytest.raises(ConfigError, match="already registered"):
        register(TOY)
    with pytest.raises(ConfigError, match="identifier"):
        register(Kind(**{**TOY.__dict__, "name": "self token"}))
    with pytest.raises(ConfigError, match="no atlas kind 'nothing'"):
        unregister("nothing")
    with pytest.raises(ConfigError, match="no atlas kind"):
        Thresholds(nothing=0.5)
    # a kind this model cannot serve is left out of the default set with its reason, and refused when asked for
    register(Kind(**{**TOY.__dict__, "name": "needs_more", "unavailable": lambda run: "needs a bigger model"}))
    try:
        with pytest.raises(ConfigError, match="needs_more.*needs a bigger model"):
            atlas(model, kinds=["needs_more"], **RUN)
        a = atlas(model, kinds=None, checks=False, copying=False, evidence=False, **RUN)
        assert a.skipped["needs_more"] == "needs a bigger model" and "self_token" in a.kinds
    finally:
        unregister("needs_more")


def test_an_unregistered_kind_leaves_no_trace(plain):
    assert "self_token" not in KINDS and "self_token" not in plain.scores and "self_token" not in Thresholds().as_dict()
    assert list(KINDS)[:7] == ["previous_token", "duplicate_token", "induction", "retrieval", "sink", "local",
                               "syntactic"]
