"""Train DuoAttention's gates (one per kv head) on SmolLM2-135M and write them for the KV study.

DuoAttention (Xiao et al. 2024) trains a gate per kv head on synthetic passkey contexts so that the mixed
model (each head ``a * full + (1 - a) * window``) keeps the full model's hidden states where the keys are
recited, with an L1 pull towards the window. ``headlab.decode.train.train_gates`` does that here, on headlab's
own filler (not the test's), against the study's window (4 sinks + 256 recent). Writes
``results/kv_gates.json`` (the gates, the loss per step, the settings); ``bench_kv_study.py`` ranks kv heads
by them.

    python benchmarks/bench_kv_train.py                      # 512-token contexts, 4 keys, 80 steps (resumable)
    python benchmarks/bench_kv_train.py --steps 120 --seconds 1800
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

import headlab  # noqa: E402
from headlab import kv  # noqa: E402
from headlab.decode.train import train_gates  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--window", default="4,256", help="SINK,RECENT the gates choose against")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per training context")
    ap.add_argument("--contexts", type=int, default=16)
    ap.add_argument("--keys", type=int, default=4, help="keys per context")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--l1", type=float, default=0.05)
    ap.add_argument("--seconds", type=float, default=None, help="time budget")
    ap.add_argument("--checkpoint", default=str(Path(__file__).resolve().parent / "results" / "kv_gates_run.json"))
    args = ap.parse_args(argv)
    lm = headlab.load(args.model)
    t = train_gates(lm, rest=kv.window(*(int(x) for x in args.window.split(","))), tokens=args.tokens, contexts=args.contexts, keys=args.keys,
                    steps=args.steps, lr=args.lr, l1=args.l1, seconds=args.seconds, checkpoint=args.checkpoint)
    g = t.gates.clamp(0, 1)
    print(f"{t.steps} steps in {t.seconds:.0f} s ({t.stopped}); loss {t.losses[0]:.4f} -> {t.losses[-1]:.4f}")
    print(f"gates: {int((g > 0.5).sum())} of {g.numel()} above 0.5; per layer (max over kv heads):")
    print(" ".join(f"{float(x):.2f}" for x in g.max(1).values))
    path = write_json("kv_gates", {"model": args.model, "args": vars(args), **t.to_json()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
