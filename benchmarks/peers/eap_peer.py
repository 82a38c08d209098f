"""EAP edge scores from an established tool, for an edge-by-edge comparison with headlab's EAP.

Runs OUTSIDE headlab's venv, with one of two peer environments (see benchmarks/peers/README.md):

    --tool tl            TransformerLens 4.3 (TransformerBridge) ``attribution_patch(granularity="edge")``;
                         venv /work/peer-venv (torch 2.13.0+cpu, transformer-lens 4.3.0, transformers 5.25).
    --tool auto-circuit  auto-circuit 1.0.1 ``mask_gradient_prune_scores(grad_function="logit", mask_val=0)``,
                         which its docs call exactly EAP (Syed et al. 2023); auto-circuit needs the legacy
                         HookedTransformer, so venv /work/peer-venv-ac (transformer-lens 2.16.1, transformers 4.57).

    eap_peer.py --model-dir DIR --pairs pairs.pt --out scores.json [--tool tl|auto-circuit]

``pairs.pt``: {"clean": (B, L), "corrupted": (B, L), "answer": (B,), "wrong": (B,)} token ids, no padding.
Metric: mean over b of logits[b, -1, answer[b]] - logits[b, -1, wrong[b]].

Score of an edge u -> v (headlab's convention): (a_u(corrupted) - a_u(clean)) . d metric / d input_v at the
clean run, summed over positions, so it estimates patched-minus-clean of the mean metric.

Edge names (Hanna et al.'s EAP-IG convention): senders ``input``, ``a{l}.h{h}``, ``m{l}``; receivers
``a{l}.h{h}<q>``, ``a{l}.h{g}<k>``, ``a{l}.h{g}<v>`` (g a kv head on grouped-query models), ``m{l}``, ``logits``.

The model is read from local files only (HF_HUB_OFFLINE=1): an HF folder with config.json and
model.safetensors. No weight processing: no layer-norm folding, no weight centring (the bridge keeps raw
HF weights; the legacy HookedTransformer is loaded with fold_ln=False, center_writing_weights=False,
center_unembed=False, fold_value_biases=False), so gradients at the receivers are those of the HF model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def load_pairs(path: str) -> dict[str, torch.Tensor]:
    p = torch.load(path)
    for k in ("clean", "corrupted", "answer", "wrong"):
        if k not in p:
            raise SystemExit(f"{path} lacks {k!r}")
    if p["clean"].shape != p["corrupted"].shape or p["clean"].ndim != 2:
        raise SystemExit(f"clean {tuple(p['clean'].shape)} and corrupted {tuple(p['corrupted'].shape)} must be "
                         "equal 2-D shapes")
    return {k: p[k].long() for k in ("clean", "corrupted", "answer", "wrong")}


def logit_diff(logits: torch.Tensor, answer: torch.Tensor, wrong: torch.Tensor) -> torch.Tensor:
    last = logits[:, -1, :]
    idx = torch.arange(last.shape[0])
    return (last[idx, answer] - last[idx, wrong]).mean()


def load_hf(model_dir: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    config = AutoConfig.from_pretrained(model_dir)
    # transformers 5 writes rope_theta inside rope_parameters; transformers 4 would silently take the
    # default 10000 from such a config, so carry it over explicitly (a no-op under transformers 5)
    rp = raw.get("rope_parameters") or {}
    if "rope_theta" in rp and "rope_theta" not in raw and hasattr(config, "rope_theta"):
        try:
            config.rope_theta = rp["rope_theta"]
        except Exception:  # noqa: BLE001  (transformers 5 configs may make it read-only)
            pass
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                                     attn_implementation="eager")
    except ValueError as e:
        if "safetensors" not in str(e):
            raise
        # transformers 4 refuses a safetensors file without {"format": "pt"} metadata (headlab's dequantised
        # SmolLM2 has none): build from the config and load the tensors by hand
        from safetensors.torch import load_file

        config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        sd = load_file(str(Path(model_dir) / "model.safetensors"))
        tied = bool(getattr(config, "tie_word_embeddings", False))
        emb = model.get_input_embeddings()
        emb_key = next(k for k, v in model.state_dict(keep_vars=True).items() if v is emb.weight)
        if tied and "lm_head.weight" in sd and emb_key not in sd:  # tied weights stored once, under either name
            sd[emb_key] = sd["lm_head.weight"]
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if tied:
            model.tie_weights()
        bad = [k for k in missing if not (k == "lm_head.weight" and tied)]
        if bad or unexpected:
            raise SystemExit(f"{model_dir}: missing {bad[:5]}, unexpected {unexpected[:5]}") from e
    return model.eval(), raw


# --------------------------------------------------------------------------------------------------------
# TransformerLens 4.3: TransformerBridge + tools.analysis.attribution_patching
# --------------------------------------------------------------------------------------------------------

def tl_node_name(node) -> str:
    k = node.kind
    if k == "embed":
        return "input"
    if k == "attn_head_out":
        return f"a{node.layer}.h{node.head}"
    if k == "mlp_out":
        return f"m{node.layer}"
    if k in ("q_input", "k_input", "v_input"):
        return f"a{node.layer}.h{node.head}<{k[0]}>"
    if k == "mlp_in":
        return f"m{node.layer}"
    if k == "logits":
        return "logits"
    raise ValueError(k)


def run_tl(model_dir: str, pairs: dict[str, torch.Tensor]) -> tuple[dict[str, float], dict]:
    from transformers import AutoTokenizer

    import transformer_lens
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.tools.analysis import attribution_patching as ap

    t0 = time.perf_counter()
    hf, raw = load_hf(model_dir)
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception:  # noqa: BLE001  (a folder without a tokenizer: ids are given, none is needed)
        tok = None
    bridge = TransformerBridge.boot_transformers(model_dir, hf_model=hf, tokenizer=tok, device="cpu")
    bridge.eval()
    load_s = time.perf_counter() - t0

    clean, corr, ans, wrong = pairs["clean"], pairs["corrupted"], pairs["answer"], pairs["wrong"]
    with torch.no_grad():
        m_clean = float(logit_diff(bridge(clean), ans, wrong))
        m_corr = float(logit_diff(bridge(corr), ans, wrong))
        hf_clean = float(logit_diff(hf(clean).logits, ans, wrong))

    n_heads = int(bridge.cfg.n_heads)
    n_kv = getattr(bridge.cfg, "n_key_value_heads", None) or n_heads
    patched = []
    if n_kv != n_heads:
        # TL 4.3 refuses edge granularity on GQA (its k/v readers would be per query head). Its hooks are
        # per kv head already (blocks.l.attn.hook_k_input is [B, S, n_kv, d]), so the sweep is right once
        # the check is lifted and k/v readers are enumerated per kv head (head index = kv head).
        orig_enum = ap.enumerate_edges

        def enumerate_edges_gqa(model, cache):
            kv = {l: cache.activations[f"blocks.{l}.attn.hook_k_input"].shape[2] for l in range(model.cfg.n_layers)}
            return [(w, r) for (w, r) in orig_enum(model, cache)
                    if not (r.kind in ("k_input", "v_input") and r.head >= kv[r.layer])]

        ap._check_kv_heads_match_query_heads = lambda model: None
        ap.enumerate_edges = enumerate_edges_gqa
        patched.append("GQA: lifted _check_kv_heads_match_query_heads; k/v readers per kv head")

    config = ap.EdgeAttributionConfig(granularity="edge", ig_steps=1)
    B = clean.shape[0]
    scores: dict[str, float] = {}
    t1 = time.perf_counter()
    for b in range(B):
        a_b, w_b = int(ans[b]), int(wrong[b])

        def metric_fn(logits, a_b=a_b, w_b=w_b):
            return (logits[:, -1, a_b] - logits[:, -1, w_b]).mean()

        # TL's convention is denoising: (a(clean arg) - a(corrupt arg)) . grad at the corrupt arg.
        # Passing clean=corrupted, corrupt=clean gives (a_corrupted - a_clean) . grad at the clean run.
        res = ap.attribution_patch(bridge, corr[b:b + 1], clean[b:b + 1], metric_fn, config)
        for (w, r), s in res.edge_scores.items():
            name = f"{tl_node_name(w)}->{tl_node_name(r)}"
            scores[name] = scores.get(name, 0.0) + s / B  # sum over positions; mean over examples
    eap_s = time.perf_counter() - t1
    meta = {"tool": "transformer-lens", "version": transformer_lens.__version__ if hasattr(transformer_lens, "__version__") else _dist_version("transformer-lens"),
            "api": "transformer_lens.tools.analysis.attribution_patching.attribution_patch(granularity='edge')",
            "model_load": "TransformerBridge.boot_transformers(dir, hf_model=AutoModelForCausalLM(eager, fp32)) "
                          "(raw HF weights, no compatibility mode / no processing)",
            "patches": patched, "metric_clean": m_clean, "metric_corrupted": m_corr, "metric_clean_hf": hf_clean,
            "load_s": load_s, "eap_s": eap_s, "n_layers": int(bridge.cfg.n_layers), "n_heads": n_heads,
            "n_kv_heads": int(n_kv)}
    return scores, meta


# --------------------------------------------------------------------------------------------------------
# auto-circuit 1.0.1 on the legacy HookedTransformer (transformer-lens 2.x)
# --------------------------------------------------------------------------------------------------------

def ac_node(name: str) -> tuple[str, str | None]:
    """auto-circuit node name -> (our name, q/k/v letter or None). 'A3.2.Q', 'A3.2', 'MLP 4', 'Resid Start/End'."""
    if name == "Resid Start":
        return "input", None
    if name == "Resid End":
        return "logits", None
    if name.startswith("MLP "):
        return f"m{int(name[4:])}", None
    parts = name[1:].split(".")
    return f"a{int(parts[0])}.h{int(parts[1])}", (parts[2].lower() if len(parts) > 2 else None)


def build_hooked_transformer(model_dir: str):
    from transformer_lens import HookedTransformer
    from transformer_lens.loading_from_pretrained import get_pretrained_model_config, get_pretrained_state_dict

    hf, raw = load_hf(model_dir)
    cfg = get_pretrained_model_config(model_dir, fold_ln=False, device="cpu", dtype=torch.float32)
    rope = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    if cfg.positional_embedding_type == "rotary" and rope is not None:
        cfg.rotary_base = float(rope)  # TL 2.x's Llama config path leaves the 10,000 default
    if cfg.n_key_value_heads is not None:
        cfg.ungroup_grouped_query_attention = True  # auto-circuit's k/v dest nodes are per query head
    cfg.tokenizer_name = None  # token ids are given; transformers 4 cannot read a transformers-5 tokenizer_config
    model = HookedTransformer(cfg)
    sd = get_pretrained_state_dict(model_dir, cfg, hf_model=hf)
    model.load_and_process_state_dict(sd, fold_ln=False, center_writing_weights=False, center_unembed=False,
                                      fold_value_biases=False, refactor_factored_attn_matrices=False)
    model.eval()
    return model, hf, cfg


def run_auto_circuit(model_dir: str, pairs: dict[str, torch.Tensor]) -> tuple[dict[str, float], dict]:
    from auto_circuit.data import PromptDataLoader, PromptDataset
    from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores
    from auto_circuit.types import AblationType
    from auto_circuit.utils.graph_utils import patchable_model

    t0 = time.perf_counter()
    model, hf, cfg = build_hooked_transformer(model_dir)
    clean, corr, ans, wrong = pairs["clean"], pairs["corrupted"], pairs["answer"], pairs["wrong"]
    with torch.no_grad():
        m_clean = float(logit_diff(model(clean), ans, wrong))
        m_corr = float(logit_diff(model(corr), ans, wrong))
        hf_clean = float(logit_diff(hf(clean).logits, ans, wrong))
    del hf
    model.set_use_attn_result(True)
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    model = patchable_model(model, factorized=True, slice_output="last_seq", seq_len=None, separate_qkv=True,
                            device=torch.device("cpu"))
    B = clean.shape[0]
    ds = PromptDataset(clean, corr, [a.view(1) for a in ans], [w.view(1) for w in wrong])
    loader = PromptDataLoader(ds, seq_len=clean.shape[1], diverge_idx=0, batch_size=B, shuffle=False)
    load_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    ps = mask_gradient_prune_scores(model, loader, None, grad_function="logit", answer_function="avg_diff",
                                    mask_val=0.0, ablation_type=AblationType.RESAMPLE, clean_corrupt="corrupt")
    eap_s = time.perf_counter() - t1

    # the mask gradient is d(-mean logit diff)/d mask at mask 0 (the clean run), mask interpolating each edge
    # from clean to corrupted: -1 x our score. Ungrouped GQA: a kv head's k/v score is its query heads' sum.
    group = cfg.n_heads // cfg.n_key_value_heads if cfg.n_key_value_heads else 1
    scores: dict[str, float] = {}
    for e in model.edges:
        s = -float(ps[e.dest.module_name][e.patch_idx])
        src, _ = ac_node(e.src.name)
        dst, letter = ac_node(e.dest.name)
        if letter is None:
            recv = dst
        elif letter == "q":
            recv = f"{dst}<q>"
        else:
            layer, h = dst[1:].split(".h")
            recv = f"a{layer}.h{int(h) // group}<{letter}>"
        name = f"{src}->{recv}"
        scores[name] = scores.get(name, 0.0) + s
    meta = {"tool": "auto-circuit", "version": _dist_version("auto-circuit"),
            "transformer_lens": _dist_version("transformer-lens"),
            "api": "auto_circuit.prune_algos.mask_gradient.mask_gradient_prune_scores(grad_function='logit', "
                   "answer_function='avg_diff', mask_val=0.0, ablation_type=RESAMPLE, clean_corrupt='corrupt')",
            "model_load": "HookedTransformer(get_pretrained_model_config(dir)) + load_and_process_state_dict("
                          "fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False)"
                          + (", ungroup_grouped_query_attention=True (k/v summed over each kv head's query heads)"
                             if cfg.n_key_value_heads else ""),
            "patches": [], "metric_clean": m_clean, "metric_corrupted": m_corr, "metric_clean_hf": hf_clean,
            "load_s": load_s, "eap_s": eap_s, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_key_value_heads or cfg.n_heads}
    return scores, meta


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    try:
        return version(name)
    except Exception:  # noqa: BLE001
        return "?"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--pairs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tool", choices=["tl", "auto-circuit"], default="tl")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    pairs = load_pairs(a.pairs)
    run = run_tl if a.tool == "tl" else run_auto_circuit
    scores, meta = run(a.model_dir, pairs)
    meta.update({"model_dir": str(a.model_dir), "pairs": str(a.pairs), "batch": int(pairs["clean"].shape[0]),
                 "seq_len": int(pairs["clean"].shape[1]), "n_edges": len(scores), "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "wall_s": time.perf_counter() - t0,
                 "peak_rss_mb": peak_rss_mb(), "python": sys.version.split()[0],
                 "score": "(a_corrupted - a_clean) . d mean-logit-diff / d receiver input at clean, summed over "
                          "positions"})
    out = {"_meta": meta}
    out.update(dict(sorted(scores.items())))
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{a.tool}: {len(scores)} edges, metric clean {meta['metric_clean']:.4f} (HF {meta['metric_clean_hf']:.4f})"
          f" corrupted {meta['metric_corrupted']:.4f}; load {meta['load_s']:.1f} s, EAP {meta['eap_s']:.1f} s, "
          f"wall {meta['wall_s']:.1f} s, peak RSS {meta['peak_rss_mb']:.0f} MB -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
