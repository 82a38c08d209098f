"""``headlab.decode.train_gates`` runs the ``train-gates`` instrument through the study runner: its steps are the
runner's units (the progress callable sees them), its gates and losses are those of the steps taken one by one on a
:class:`GateTrainer` (the independent computation), and its ``checkpoint=`` is the runner's checkpoint (the kept
steps in the run's JSON file: saved every ``save_every`` steps, read back by the next call, which runs only the
rest)."""

from __future__ import annotations

import pytest
import torch
import transformers

from headlab import kv
from headlab.decode.train import GateTrainer, train_gates
from headlab.errors import ConfigError
from headlab.interpret.study import runner
from headlab.results import Result


def _tiny(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, attn_implementation="eager")).eval()


def _data(n=3):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 61, (1, 30), generator=g), torch.arange(20, 29)) for _ in range(n)]


def test_train_gates_is_the_instruments_units_and_equals_the_steps_taken_by_hand(monkeypatch):
    lm, data = _tiny(), _data()
    calls, seen = [], []
    real = runner.call
    monkeypatch.setattr(runner, "call", lambda name, options, **kw: (calls.append(name), real(name, options, **kw))[1])
    t = train_gates(lm, data=data, rest=kv.window(1, 4), steps=4, lr=0.05, l1=0.02,
                    progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert calls == ["train-gates"]
    assert seen == [("training gates", i, 4) for i in range(5)]  # the runner's units, one per step
    by_hand = GateTrainer(lm, rest=kv.window(1, 4), data=data, steps=4, lr=0.05, l1=0.02)
    with by_hand.frozen():
        losses = [by_hand.step() for _ in range(4)]
    assert t.losses == losses and t.steps == 4 and t.stopped == "steps"
    assert torch.equal(t.gates, by_hand.param.detach())
    assert t.settings == by_hand.state.settings and t.rest == kv.window(1, 4)


def test_the_checkpoint_is_the_runners_saved_every_n_steps_and_resumed(tmp_path, monkeypatch):
    """A run that dies in step 4 (not Ctrl-C: nothing is written then) keeps the two steps saved at step 2; the next
    call with the same path runs steps 3 to 5 only and ends with the gates of an uninterrupted run."""
    import headlab.decode.train as T

    lm, data = _tiny(1), _data()
    straight = train_gates(lm, data=data, rest=kv.window(1, 4), steps=5, progress=False)
    ck, real, calls = tmp_path / "gates.json", T.gated, []

    def dies_in_step_4(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("killed")
        return real(*a, **k)

    monkeypatch.setattr(T, "gated", dies_in_step_4)
    with pytest.raises(RuntimeError, match="killed"):
        train_gates(lm, data=data, rest=kv.window(1, 4), steps=5, checkpoint=ck, save_every=2, progress=False)
    kept = Result.load(ck)
    assert kept.kind == "kv_gates" and kept.figures["interrupted"] == {"kept": 2, "of": 5}
    assert list(kept.figures["units"]) == ["1", "2"] and kept.figures["units"]["2"]["loss"] == straight.losses[1]
    calls.clear()
    monkeypatch.setattr(T, "gated", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = train_gates(lm, data=data, rest=kv.window(1, 4), steps=5, checkpoint=ck, progress=False)
    assert len(calls) == 3  # steps 3, 4 and 5
    assert resumed.losses == straight.losses and torch.equal(resumed.gates, straight.gates)
    assert list(Result.load(ck).figures["units"]) == [str(i) for i in range(1, 6)]  # the finished file keeps them
    calls.clear()
    more = train_gates(lm, data=data, rest=kv.window(1, 4), steps=6, checkpoint=ck, progress=False)
    assert len(calls) == 1 and more.steps == 6 and more.losses[:5] == straight.losses


def test_ctrl_c_raises_and_keeps_the_finished_steps_and_a_checkpoint_must_be_json(tmp_path, monkeypatch):
    import headlab.decode.train as T

    lm, data = _tiny(2), _data(2)
    real, calls = T.gated, []

    def ctrl_c_in_step_3(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(T, "gated", ctrl_c_in_step_3)
    ck = tmp_path / "g.json"
    with pytest.raises(KeyboardInterrupt):
        train_gates(lm, data=data, rest=kv.window(1, 4), steps=4, checkpoint=ck, progress=False)
    assert list(Result.load(ck).figures["units"]) == ["1", "2"]
    with pytest.raises(ConfigError, match=r"checkpoint='.*g\.ckpt': .* give a path ending in \.json"):
        train_gates(lm, data=data, rest=kv.window(1, 4), steps=4, checkpoint=tmp_path / "g.ckpt", progress=False)
    with pytest.raises(ConfigError, match=r"^save_every must be at least 1, got 0"):  # named as Python names it
        train_gates(lm, data=data, rest=kv.window(1, 4), checkpoint=ck, save_every=0, progress=False)
