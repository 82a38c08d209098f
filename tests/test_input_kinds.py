"""Every input kind and stack (issue 40, item 5), each answer against its definition computed here by hand.

- audio models without input embeddings take their inputs typed: token ids are refused with an InputError naming
  the input they take (not transformers' NotImplementedError); a padded audio batch's losses run over the real
  frames (the model's own rule from samples to frames), equal to each example run alone, unpadded;
- a conformer with rotary positions and time-major features (LASR) is read and served;
- importance and ablation on encoder-decoder examples of different lengths score the decoder's own tokens:
  ``loss="lm"`` is the NLL of the decoder's tokens (of ``labels`` where given: the model's own loss), and the
  importance equals ``E_x |dL(x)/d gate|`` taken here with autograd on each example alone;
- rollout and flow on an encoder-decoder answer for each stack when none is named (Abnar and Zuidema's rollout,
  and the max flow of the paper's graph computed with networkx, from that stack's eager maps); a stack named
  explicitly gives the same numbers; norms say which layers each stack's are.
"""

from __future__ import annotations

import architectures as A
import networkx as nx
import pytest
import torch
import torch.nn.functional as F
import transformers as T

import headlab
from headlab.errors import InputError
from headlab.interpret.flow.stacks import PerStack
from headlab.models import adapt


def _wave(cls, **kw):
    """A tiny wav2vec2 with a layer-norm front end (it takes an attention_mask, so padding is exact)."""
    torch.manual_seed(0)
    cfg = T.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           conv_dim=(8, 8), conv_stride=(4, 4), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
                           num_conv_pos_embedding_groups=2, feat_extract_norm="layer", do_stable_layer_norm=True,
                           attn_implementation="eager", vocab_size=12, **kw)
    return cls(cfg).eval()


def _padded_audio(g_seed=3):
    g = torch.Generator().manual_seed(g_seed)
    a, b = torch.randn(1, 400, generator=g), torch.randn(1, 272, generator=g)
    padded = torch.cat([b, torch.zeros(1, 128)], 1)
    mask = torch.cat([torch.ones(1, 272, dtype=torch.long), torch.zeros(1, 128, dtype=torch.long)], 1)
    ex = [{"input_values": a, "attention_mask": torch.ones(1, 400, dtype=torch.long)},
          {"input_values": padded, "attention_mask": mask}]
    return ex, [a, b]


def test_audio_models_refuse_token_ids_typed():
    m = A.build("wav2vec2")
    a = adapt(m)
    ids = torch.randint(0, 50, (1, 7))
    for given in (ids, {"input_ids": ids}):
        with pytest.raises(InputError, match="takes 'input_values'"):
            headlab.capture(m, given, a.sites("pattern"))
    with pytest.raises(InputError, match="takes 'input_values'"):
        headlab.head_importance(m, [ids[0]], batch_size=1)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(InputError, match="of shapes"):  # audio of two lengths, no mask: refused, not padded
        headlab.head_importance(m, [{"input_values": torch.randn(1, 400, generator=g)},
                                    {"input_values": torch.randn(1, 300, generator=g)}], batch_size=2)


@pytest.mark.parametrize("head", ["ctc", "encoder"])
def test_padded_audio_losses_run_over_the_real_frames(head):
    """Zero-ablating a head of a padded batch changes each example's loss as on that example alone, unpadded:
    the KL per real frame of a CTC head (loss='kl', auto), or the cosine distance of the mean over real frames
    of a bare encoder (loss='cosine', auto)."""
    m = _wave(T.Wav2Vec2ForCTC if head == "ctc" else T.Wav2Vec2Model)
    if head == "ctc":  # sharp frame distributions: effects far above float32's rounding of the KL
        with torch.no_grad():
            m.lm_head.weight.mul_(200.0)
    a = adapt(m)
    ex, alone = _padded_audio()
    r = headlab.ablate(m, ex, heads=[(0, 1), (1, 2)], k=2, keep_one=False, n_boot=10, cka=False, batch_size=2)
    assert r.loss == ("kl" if head == "ctc" else "cosine")
    for layer, h in ((0, 1), (1, 2)):
        per = []
        for x in alone:
            with torch.no_grad():
                o0 = m(input_values=x)
                a.gates[layer, h] = 0.0
                o1 = m(input_values=x)
                a.reset_gates()
            if head == "ctc":
                p0, p1 = F.log_softmax(o0.logits.double(), -1), F.log_softmax(o1.logits.double(), -1)
                per.append(float((p0.exp() * (p0 - p1)).sum(-1).mean()))
            else:
                e0, e1 = o0.last_hidden_state.double().mean(1), o1.last_hidden_state.double().mean(1)
                per.append(float(1 - F.cosine_similarity(e0, e1, dim=-1)))
        assert per[0] > 0 and per[1] > 0
        # 1 - cos of float32 embeddings near 1 keeps about 3 digits; the KL, sharper, 4
        assert float(r.single[layer, h]) == pytest.approx(sum(per) / 2, rel=1e-4 if head == "ctc" else 1e-2)


def test_a_conformer_with_rotary_positions_and_time_major_features():
    """LASR: mel frames (B, frames, mel) through a linear front end, rotary positions inside attention."""
    torch.manual_seed(0)
    m = T.LasrEncoder(T.LasrEncoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=4, intermediate_size=64, num_mel_bins=16,
                                          subsampling_conv_channels=16, conv_kernel_size=3,
                                          attn_implementation="eager")).eval()
    a = adapt(m)
    x = {"input_features": torch.randn(2, 48, 16, generator=torch.Generator().manual_seed(1))}
    with torch.no_grad():
        eager = m(**x, output_attentions=True).attentions
    cache = headlab.capture(m, x, a.sites("pattern"))
    for layer in range(a.n_layers):
        torch.testing.assert_close(cache[a.site_name(layer, "pattern")], eager[layer], atol=1e-5, rtol=1e-5)
    imp = headlab.head_importance(m, [{k: v[i:i + 1] for k, v in x.items()} for i in range(2)], batch_size=2)
    assert imp.shape == (2, 4) and torch.isfinite(imp).all() and (imp > 0).any()


def _by_hand_importance(model, examples, loss_of):
    """``E_x |d loss_of(model, x) / d gates|`` with autograd, each example alone."""
    a = adapt(model)
    total = torch.zeros(a.n_layers, a.n_heads, dtype=torch.float64)
    a.gates.requires_grad_(True)
    try:
        for x in examples:
            (g,) = torch.autograd.grad(loss_of(model, x), a.gates)
            total += g.abs().double()
    finally:
        a.gates.requires_grad_(False)
    return total / len(examples)


def _decoder_nll(model, x):
    lg = model(**x).logits.double()
    ids = x["decoder_input_ids"]
    return F.cross_entropy(lg[0, :-1], ids[0, 1:])


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_importance_on_encoder_decoder_examples_scores_the_decoders_tokens(name):
    """Examples of different encoder and decoder lengths (a size mismatch before): the teacher-forced NLL of the
    decoder's own tokens, each example's gradient taken alone."""
    m = A.build(name)
    x = A.inputs(name, padded=False)
    ex = [{"input_ids": x["input_ids"][:1], "decoder_input_ids": x["decoder_input_ids"][:1]},
          {"input_ids": x["input_ids"][1:, :8], "decoder_input_ids": x["decoder_input_ids"][1:, :4]}]
    got = headlab.head_importance(m, ex, loss="lm", batch_size=2)
    want = _by_hand_importance(m, ex, _decoder_nll)
    assert float(want.max()) > 0
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-4)
    # ablation of the same examples: a zeroed head's effect on that NLL
    a = adapt(m)
    r = headlab.ablate(m, ex, heads=[(0, 1), (a.stacks["cross"][0], 2)], k=2, keep_one=False, n_boot=10, cka=True,
                       loss="lm", batch_size=2)
    for layer, h in ((0, 1), (a.stacks["cross"][0], 2)):
        with torch.no_grad():
            base = [float(_decoder_nll(m, e)) for e in ex]
            a.gates[layer, h] = 0.0
            cut = [float(_decoder_nll(m, e)) for e in ex]
            a.reset_gates()
        effect = sum(c - b for c, b in zip(cut, base)) / 2
        # differences of float32 NLLs near 4.6: about 5e-7 of rounding
        assert float(r.single[layer, h]) == pytest.approx(effect, rel=1e-3, abs=1e-6)


def test_importance_with_labels_is_the_models_own_loss():
    """Whisper given labels (no decoder ids): the model shifts them in, and the loss is its own."""
    m = A.build("whisper")
    x = A.inputs("whisper")
    labels = x["decoder_input_ids"]
    ex = [{"input_features": x["input_features"][i:i + 1], "labels": labels[i:i + 1]} for i in range(2)]
    got = headlab.head_importance(m, ex, loss="lm", batch_size=2)
    want = _by_hand_importance(m, ex, lambda model, e: model(**e).loss)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-4)


def _rollout_by_hand(maps):
    n = maps[0].shape[-1]
    eye = torch.eye(n, dtype=torch.float64)
    R = None
    for P in maps:
        Ah = 0.5 * P[0].double().mean(0) + 0.5 * eye
        Ah = Ah / Ah.sum(-1, keepdim=True)
        R = Ah if R is None else Ah @ R
    return R


def _flow_by_hand(maps, source):
    """Abnar and Zuidema's graph: node (l, j) for l = 0..L, an edge (l, j) -> (l + 1, i) of capacity A_hat_l[i, j];
    the max flow from (L, source) to each (0, j), normalised."""
    n = maps[0].shape[-1]
    eye = torch.eye(n, dtype=torch.float64)
    G = nx.DiGraph()
    for l, P in enumerate(maps):
        Ah = 0.5 * P[0].double().mean(0) + 0.5 * eye
        Ah = Ah / Ah.sum(-1, keepdim=True)
        for i in range(n):
            for j in range(n):
                if Ah[i, j] > 0:  # flow runs from the output node back towards the inputs
                    G.add_edge((l + 1, i), (l, j), capacity=float(Ah[i, j]))
    vals = torch.tensor([nx.maximum_flow_value(G, (len(maps), source), (0, j)) for j in range(n)],
                        dtype=torch.float64)
    return vals / vals.sum()


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_rollout_flow_and_norms_answer_for_each_stack(name):
    m = A.build(name)
    a = adapt(m)
    seq = {k: v[:1] for k, v in A.inputs(name, padded=False).items()}
    with torch.no_grad():
        out = m(**seq, output_attentions=True)
    own = {"encoder": out.encoder_attentions, "decoder": out.decoder_attentions}
    ro = headlab.rollout(m, seq)
    assert isinstance(ro, PerStack) and ro.stacks == ["encoder", "decoder"]
    assert ro.layers == {"encoder": a.stacks["encoder"], "decoder": a.stacks["decoder"]}
    assert any("cross-attention" in n for n in ro.notes)
    fl = headlab.attention_flow(m, seq, source=-1)
    assert isinstance(fl, PerStack) and fl.stacks == ["encoder", "decoder"]
    for stack, maps in own.items():
        torch.testing.assert_close(ro[stack].maps[-1].double(), _rollout_by_hand(maps), atol=1e-5, rtol=1e-5)
        named = headlab.rollout(m, seq, stack=stack)
        assert torch.equal(named.maps, ro[stack].maps) and ro[stack].stack == named.stack == stack
        n = maps[0].shape[-1]
        torch.testing.assert_close(fl[stack].flow.double(), _flow_by_hand(maps, n - 1), atol=1e-6, rtol=1e-5)
        assert torch.equal(headlab.attention_flow(m, seq, source=-1, stack=stack).flow, fl[stack].flow)
    # a layer named without a stack: the stack holding it
    dec_top = a.stacks["decoder"][-1]
    assert torch.equal(headlab.rollout(m, seq, layer=dec_top).maps, ro["decoder"].maps)
    assert ro.to_json()["stacks"] == ["encoder", "decoder"]
    # norms: every stack's layers, said in the result; stack= gives that stack's layers, the same numbers
    nr = headlab.attention_norms(m, seq)
    assert nr.stacks == {k: list(v) for k, v in a.stacks.items()} and any("encoder-decoder" in n for n in nr.notes)
    dec = headlab.attention_norms(m, seq, stack="decoder")
    assert dec.layers == a.stacks["decoder"] and dec.stacks == {"decoder": a.stacks["decoder"]}
    for l in dec.layers:  # the layers below run on the backend chosen, not on the reference: float rounding apart
        torch.testing.assert_close(dec.layer[l], nr.layer[l], atol=1e-5, rtol=1e-5)
