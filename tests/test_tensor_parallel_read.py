"""The reading instruments on a model sharded by tensor parallelism (transformers' own plan) equal one process.

Tiny 2-layer models of four families (Llama with GQA, Qwen2 with q/k/v biases, Qwen3 with q/k norms, Gemma 3 with
sandwich norms and a sliding window) are saved with a word-level tokenizer; 2 and 4 local gloo
ranks load them with ``headlab.load(..., tensor_parallel=True)`` (tests/workers/tp_read_worker.py; one launch per
world reads every model of that world) and run value-aware norms (maps, rows and streaming summaries, attention and
residual modes), the value norms, rollout (mean and norm, full maps and top-down rows), attention flow, the logit
lens, direct logit attribution, ``headlab.capture(..., grads=True)`` (every head site and the gates,
in global head order) and ``headlab analyze``'s per-head table. Each is compared here with one process on
the unsharded model, in float32 (atol 1e-5): the one-process result is the independent computation, and it depends
on the head order (checked below), so a rank that read its heads' weights in the wrong order, or only its own
heads, would fail.

Encoders: the installed transformers has tensor-parallel plans for EuroBERT (and UltraBERT, ESMC). EuroBERT is a
declared family (a Llama-style encoder) and reads sharded like the decoders; a type read by structure (no family
class) is read whole and cut after (tests/test_tp_structure.py); a world size that does not divide its heads is
refused from the config, before loading (the last test).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import headlab

from conftest import save_word_level
from test_tensor_parallel import run_world, tiny_llama

WORKER = Path(__file__).parent / "workers" / "tp_read_worker.py"
sys.path.insert(0, str(WORKER.parent))
import tp_read_worker  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
              max_position_embeddings=64)


def tiny_family(path: Path, family: str, heads: int, kv_heads: int) -> Path:
    """A 2-layer model of ``family`` with random norm gains (so that the residual mode's metric and the readout's
    gain are not the identity), saved with a whitespace tokenizer over the worker's text (``headlab analyze`` reads
    text). ``llama`` and ``qwen2`` are :func:`tiny_llama`'s; ``gemma3`` alternates a sliding and a full layer."""
    import transformers

    if family in ("llama", "qwen2"):
        tiny_llama(path, heads, kv_heads, family)
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    else:
        torch.manual_seed(0)
        kw = dict(COMMON, num_attention_heads=heads, num_key_value_heads=kv_heads)
        if family == "qwen3":
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
        elif family == "gemma":
            model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**kw))
        elif family == "gemma3":
            model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
                **kw, sliding_window=4, layer_types=["sliding_attention", "full_attention"]))
        elif family == "eurobert":
            model = transformers.EuroBertForMaskedLM(transformers.EuroBertConfig(
                **kw, pad_token_id=0, bos_token_id=1, eos_token_id=1, mask_token_id=2))
        else:
            raise ValueError(family)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    words = ["<pad>", "<unk>"] + sorted(set(tp_read_worker.TEXT.split()))
    save_word_level(path, model, words)
    return path


# world, torchrun, {name: (family, query heads, kv heads)}: Llama (GQA: one kv head per rank), Qwen3 and Gemma 3 at 2
# ranks; Qwen2 at 4 ranks, one query and one kv head each, its sharded v bias gathered with the rows. (Llama with 4 kv
# heads at 4 ranks and Gemma 1 at 2 read alike; they are left out to keep the file short.)
WORLDS = {
    "world2": (2, True, {"llama-gqa": ("llama", 4, 2), "qwen3": ("qwen3", 4, 2), "gemma3": ("gemma3", 4, 2),
                         "eurobert": ("eurobert", 4, 2)}),
    "world4": (4, False, {"qwen2-bias": ("qwen2", 4, 4)}),
}


# 4 ranks on the 2 cores of CI cost minutes: the world-4 launch runs in `make test-slow`
@pytest.fixture(scope="module", params=["world2", pytest.param("world4", marks=pytest.mark.slow)])
def read_world(request, tmp_path_factory):
    world, torchrun, spec = WORLDS[request.param]
    tmp = tmp_path_factory.mktemp(f"tpread{world}")
    for name, (family, heads, kv) in spec.items():
        tiny_family(tmp / "models" / name, family, heads, kv)
    torch.set_num_threads(1)
    # 900 s: 4 ranks on a 2-core host that is busy with other work took over 300 s once
    results = run_world(world, tmp / "models", tmp / "out", torchrun=torchrun, worker=WORKER, timeout=900)
    one = {name: tp_read_worker.reads(headlab.load(tmp / "models" / name), str(tmp / "one" / name)) for name in spec}
    return world, spec, results, one


def _close(got, ref, msg: str) -> None:
    """``got`` equals ``ref``: tensors and floats to 1e-5 (NaN where ``ref`` has NaN), anything else exactly."""
    if isinstance(ref, dict):
        assert sorted(got) == sorted(ref), msg
        for k in ref:
            _close(got[k], ref[k], f"{msg} {k}")
    elif isinstance(ref, (list, tuple)) and not isinstance(got, str):
        assert len(got) == len(ref), msg
        for i, (a, b) in enumerate(zip(got, ref)):
            _close(a, b, f"{msg}[{i}]")
    elif isinstance(ref, torch.Tensor):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0, equal_nan=True, msg=msg)
    elif isinstance(ref, float):
        assert math.isclose(got, ref, abs_tol=1e-5) or (math.isnan(got) and math.isnan(ref)), (msg, got, ref)
    else:
        assert got == ref, (msg, got, ref)


READS = ["norms_attention", "norms_attention_rows", "norms_residual", "norms_residual_rows", "norms_stream",
         "value_norms", "rollout_mean", "rollout_mean_rows", "rollout_norm", "rollout_norm_rows", "flow",
         "logit_lens", "dla", "analyze", "capture_grads"]


@pytest.mark.distributed
def test_every_family_is_sharded_by_heads(read_world):
    """Each rank holds heads [r*H/w, (r+1)*H/w) of every family, and the readout's borrowed unembedding is gone
    again (the model's own get_output_embeddings answers after the logit lens)."""
    world, spec, results, _ = read_world
    for name, (_, H, _) in spec.items():
        for r, res in enumerate(results):
            got = res[name]
            assert (got["rank"], got["world"]) == (r, world), name
            assert got["heads"] == list(range(r * H // world, (r + 1) * H // world)), (name, r)
            assert got["lm_head_restored"], name


@pytest.mark.distributed
@pytest.mark.parametrize("instrument", READS)
def test_reading_instruments_equal_one_process(read_world, instrument):
    """Norms, rollout, flow, the logit lens, DLA (or its refusal, alike) and analyze's per-head table: on every
    rank of every family, what one process gives on the unsharded model."""
    world, spec, results, one = read_world
    for name in spec:
        for r, res in enumerate(results):
            _close(res[name]["reads"][instrument], one[name][instrument], f"{name} rank {r} {instrument}")


@pytest.mark.distributed
def test_the_one_process_figures_depend_on_the_head_order(read_world):
    """What makes the comparison above a test: in the one-process results, heads differ from one another (so a
    rank that put its shards in another order would disagree) and every reading measured something."""
    _, spec, _, one = read_world
    for name, (family, H, _) in spec.items():
        ref = one[name]
        for l in (0, 1):
            per_head, vn = ref["norms_attention"][f"per_head.{l}"], ref["value_norms"][str(l)]
            assert (per_head[0] - per_head[H - 1]).abs().max() > 1e-3, (name, l)
            assert (vn[0] - vn[H - 1]).abs().max() > 1e-3, (name, l)
        assert (ref["rollout_norm"] - ref["rollout_mean"]).abs().max() > 1e-4, name  # the value path counts
        assert (ref["norms_residual"]["layer.1"] - ref["norms_attention"]["layer.1"]).abs().max() > 1e-3, name
        assert ref["flow"]["flow"].sum().item() == pytest.approx(1.0, abs=1e-9), name
        lens = ref["logit_lens"]["logits"]
        assert (lens[1] - lens[2]).abs().max() > 1e-3, name  # every depth reads something else
        if family == "gemma3":
            assert "sandwich" in ref["dla"]["refused"], name
        else:
            dla = ref["dla"]
            assert (dla["heads"][:, 0] - dla["heads"][:, H - 1]).abs().max() > 1e-4, name
            torch.testing.assert_close(dla["per_example"].sum((1, 2)) + dla["rest"], dla["logit_diff"],
                                       atol=1e-4, rtol=0)
        g = ref["capture_grads"]
        for l in (0, 1):  # every head's gradient is its own, and so is every gate's
            z = g[f"grad blocks.{l}.attn.z"]
            assert z.abs().max() > 1e-4 and (z[:, 0] - z[:, H - 1]).abs().max() > 1e-5, (name, l)
            assert (g["grad gates"][l, 0] - g["grad gates"][l, H - 1]).abs() > 1e-6, (name, l)
            want = (g[f"value blocks.{l}.attn.z"] * z).sum((0, 2, 3))  # d m / d gate = <z, d m / d z> at gates 1
            torch.testing.assert_close(g["grad gates"][l], want, atol=1e-5, rtol=1e-4)
        if family == "qwen2":  # the loader takes Qwen2's own tokenizer class, which reads the word-level vocabulary
            assert "no tokens" in ref["analyze"]["refused"], name
            continue
        records = ref["analyze"]["records"]
        assert len(records) == 2 * H and len({round(r["entropy"], 6) for r in records}) > 1, name


def test_value_path_and_readout_of_an_unsharded_model_are_the_adapter_s_own(tmp_path):
    """Without tensor parallelism the helpers move nothing: the adapter's views, and readout_of's readout."""
    from headlab.models.readout import readout_of
    from headlab.models.tp_weights import readout, value_path

    loaded = headlab.load(tiny_llama(tmp_path / "m", 4, 2, "qwen2"))
    a = loaded.adapter
    WV, bV, WO = value_path(a, 1)
    assert torch.equal(WV, a.W_V(1)) and torch.equal(bV, a.b_V(1)) and torch.equal(WO, a.W_O(1))
    assert readout(a) is readout_of(a)


def test_an_encoder_read_by_structure_is_refused_before_loading(tmp_path, monkeypatch):
    """A model type no headlab family class declares is read by structure on the whole model and cut after
    (tests/test_tp_structure.py); a world size that does not divide its heads is refused from the config, before
    any weight is read, saying why and what to do. EuroBERT is declared (it runs sharded above); it is read by
    structure here by hiding its declaration."""
    from headlab.errors import ConfigError
    from headlab.models.hf import registry

    path = tiny_family(tmp_path / "eurobert", "eurobert", 4, 2)
    one = headlab.load(path)
    assert one.adapter.family == "eurobert" and one.adapter.n_heads == 4 and not one.adapter.causal
    (path / "model.safetensors").write_bytes(b"not weights")  # never read: the refusal comes from the config
    real = registry.adapter_class
    monkeypatch.setattr(registry, "adapter_class", lambda mt: None if mt == "eurobert" else real(mt))
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="over 3 ranks: the .eurobert. model has 4 query heads, which 3 does not divide"):
        headlab.load(path, tensor_parallel=True)
