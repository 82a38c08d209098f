"""A RULER-style suite on SmolLM2-135M under KV policies, with paired intervals (issue 42, item 4).

This runs the instrument ``headlab kv suite`` (:mod:`headlab.decode.suite_instrument`) through the study runner and
prints its table: the tasks come from :mod:`headlab.decode.suite` (single, multi-key and multi-value needles,
variable tracking, common-word extraction, question answering over a passage), deterministic from ``--seed``, about
``--tokens`` tokens each. Every policy answers the same tasks, query-agnostic (the context is the prefill a policy
compresses, the question comes after it), greedy decoding. A task is right when every answer is in the output.
Against the first policy, each other one gets McNemar's paired interval of the difference of accuracies with its
exact p-value, and a paired bootstrap interval of the difference of RULER's per-task scores; perplexity is on
decoded tokens (a held-out continuation teacher-forced after the prefill) for the first ``--ppl`` tasks. Bytes are
each generation's ``kv_bytes`` (what the cache held, its tensors counted) over ``kv_bytes_full``.

Being the runner's units, a long run keeps its finished tasks on Ctrl-C (or ``kill``) in ``--out``, and
``--resume`` goes on from them; the same run is ``headlab kv suite ... --out FILE``.

    python benchmarks/bench_kv_suite.py --n 48 --tokens 1024 --ppl 12
    python benchmarks/bench_kv_suite.py --policies "full;full:bits=4;adakv:256,bits=4" --n 500 --out suite500.json
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

from headlab.cli.views.kv_suite import table  # noqa: E402
from headlab.decode.suite_instrument import DEFAULT_POLICIES  # noqa: E402
from headlab.interpret.study import runner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=48, help="tasks (the six kinds in turn)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ppl", type=int, default=12, help="tasks whose held-out continuation is scored")
    ap.add_argument("--continuation", type=int, default=64, help="tokens of held-out continuation")
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help="policies separated by ';', the first the baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="the runner's result file (keeps the tasks; --resume)")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, _stop)  # `kill PID` keeps the finished tasks, as Ctrl-C does
    options = {"model": "smollm2", "policies": args.policies, "n": args.n, "tokens": args.tokens, "seed": args.seed,
               "ppl": args.ppl, "continuation": args.continuation, "out": args.out, "force": not args.resume}
    outcome = runner.run("kv-suite", options, resume=args.resume, progress=True)
    if outcome.result is None:
        return  # interrupted: the runner said where the finished tasks are
    for line in table(outcome.result.figures):
        print(line)
    write_json("kv_suite", {"args": {k: str(v) for k, v in vars(args).items()}, **outcome.result.figures})


def _stop(*_) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
