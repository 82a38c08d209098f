"""What reading attention through a module's own math costs, against the same model served through transformers'
attention interface.

The same random-weight Llama-style decoder twice, with equal weights: ``interface`` (transformers' ``LlamaAttention``,
which calls the attention interface) and ``own`` (an attention module that computes ``softmax(q k^T c + mask) v``
itself, as GPT-Neo and remote code do, served by headlab's bridge). Each case runs in a fresh process (its peak
resident set is the child's ``ru_maxrss``), interleaved over the rounds:

- ``eager``: the model's own forward (for ``own``, the bridge's hooks are installed and do nothing);
- ``tiled``: a forward on headlab's tiled backend (for ``own``, the scores are never computed: placeholders);
- ``capture``: capturing every layer's pattern (the maps are materialised by both).

    .venv/bin/python benchmarks/bench_own_math.py                      # L = 512 and 2048, 3 rounds
    .venv/bin/python benchmarks/bench_own_math.py --lengths 1024 --rounds 5

Prints a table (median seconds per forward, peak MiB) with the own / interface ratio of each, and writes
``results/own_math.json``. Run it on an idle machine; only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r'''
import sys, time, json, torch, torch.nn.functional as F
import transformers as T
from transformers.models.llama import modeling_llama as ML
T.logging.set_verbosity_error()
import headlab
from headlab.models import adapt

kind, mode, L, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = T.LlamaConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=4, intermediate_size=512, max_position_embeddings=L,
                    attn_implementation="eager")


class OwnAttention(ML.LlamaAttention):
    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kw):
        B, n, _ = hidden_states.shape
        shape = (B, n, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = ML.apply_rotary_pos_emb(q, k, *position_embeddings)
        k, v = ML.repeat_kv(k, self.num_key_value_groups), ML.repeat_kv(v, self.num_key_value_groups)
        s = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            s = s + attention_mask
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj(torch.matmul(p, v).transpose(1, 2).reshape(B, n, -1)), p


class OwnConfig(T.LlamaConfig):
    model_type = "own_llama"  # no headlab family declares it: read by structure, through the bridge


class OwnLlama(T.LlamaForCausalLM):
    config_class = OwnConfig


torch.manual_seed(0)  # equal weights: the same draws in the same order
if kind == "own":
    model = OwnLlama(OwnConfig(**{k: v for k, v in cfg.to_dict().items() if k != "model_type"})).eval()
    for layer in model.model.layers:
        layer.self_attn.__class__ = OwnAttention
else:
    model = T.LlamaForCausalLM(cfg).eval()
a = adapt(model)
assert (kind == "own") == (getattr(model, "_headlab_own", None) is not None)
ids = torch.randint(0, 1000, (1, L))
x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def once():
    with torch.no_grad():
        if mode == "eager":
            model(**x)
        elif mode == "tiled":
            with a.use_backend("tiled"):
                model(**x)
        else:
            headlab.capture(model, x, a.sites("pattern"))


once()
times = []
for _ in range(reps):
    t0 = time.perf_counter()
    once()
    times.append(time.perf_counter() - t0)
print("RESULT", json.dumps({"seconds": sorted(times)[len(times) // 2]}))
'''


def _case(kind: str, mode: str, L: int, reps: int) -> tuple[float, int]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, kind, mode, str(L), str(reps)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    out = p.stdout.read() if p.stdout else ""
    _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"case {kind}/{mode}/{L} failed")
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line.split(" ", 1)[1])["seconds"], usage.ru_maxrss * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="timed forwards per process (median)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "own_math.json")
    args = ap.parse_args()
    modes = ("eager", "tiled", "capture")
    secs: dict = {}
    peaks: dict = {}
    t0 = time.time()
    for _ in range(args.rounds):
        for L in args.lengths:
            for mode in modes:
                for kind in ("interface", "own"):
                    s, rss = _case(kind, mode, L, args.reps)
                    secs.setdefault((L, mode, kind), []).append(s)
                    peaks.setdefault((L, mode, kind), []).append(rss)
    rows = []
    print(f"{'L':>6} {'mode':>8} {'interface s':>12} {'own s':>10} {'ratio':>6} {'iface MiB':>10} {'own MiB':>8} "
          f"{'ratio':>6}")
    for L in args.lengths:
        for mode in modes:
            si, so = (statistics.median(secs[(L, mode, k)]) for k in ("interface", "own"))
            mi, mo = (max(peaks[(L, mode, k)]) / 2**20 for k in ("interface", "own"))
            rows.append({"length": L, "mode": mode, "interface_seconds": si, "own_seconds": so,
                         "time_ratio": so / si, "interface_peak_mib": mi, "own_peak_mib": mo,
                         "peak_ratio": mo / mi})
            print(f"{L:>6} {mode:>8} {si:>12.4f} {so:>10.4f} {so / si:>6.2f} {mi:>10.0f} {mo:>8.0f} {mo / mi:>6.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "reps": args.reps, "rows": rows,
                                    "wall_seconds": time.time() - t0, "cpu_count": os.cpu_count()}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
