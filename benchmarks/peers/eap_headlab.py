"""headlab's EAP on the same model and pairs as eap_peer.py, written in the same JSON form ({edge: score, "_meta"}).

    .venv/bin/python benchmarks/peers/eap_headlab.py --model-dir DIR --pairs pairs.pt --out scores.json
"""
import argparse, json, resource, sys, time
from pathlib import Path

import torch

import headlab
from headlab.interpret.circuits import edge_scores

p = argparse.ArgumentParser()
p.add_argument("--model-dir", required=True); p.add_argument("--pairs", required=True); p.add_argument("--out", required=True)
p.add_argument("--method", default="eap")
a = p.parse_args()
t0 = time.perf_counter()
pairs = torch.load(a.pairs)
m = headlab.load(a.model_dir)
ans, wrong = pairs["answer"].long(), pairs["wrong"].long()


def metric(logits):  # (B, L, V) -> (B,); headlab may pass a subset of rows only with the full batch here
    idx = torch.arange(logits.shape[0])
    return logits[idx, -1, ans[: logits.shape[0]]] - logits[idx, -1, wrong[: logits.shape[0]]]


t1 = time.perf_counter()
r = edge_scores(m, pairs["clean"], pairs["corrupted"], metric, method=a.method)
eap_s = time.perf_counter() - t1
out = {"_meta": {"tool": "headlab", "method": a.method, "eap_s": eap_s, "wall_s": time.perf_counter() - t0,
                 "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "n_edges": len(r.scores),
                 "metric_clean": getattr(r, "clean", None), "metric_corrupted": getattr(r, "corrupted", None)}}
out.update(dict(sorted(r.scores.items())))
Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
print(f"headlab {a.method}: {len(r.scores)} edges, EAP {eap_s:.1f} s -> {a.out}", file=sys.stderr)
