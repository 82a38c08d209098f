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
    python benchmarks/bench_kv_suite.py --pool seed0.json seed1.json     # runs of other seeds: one paired table

``--pool`` reads finished result files of ``headlab kv suite`` (the same policies, different ``--seed``s, so
different tasks) and pairs their tasks together, as one run over all of them would (writes ``--out``, by default
``benchmarks/results/kv_suite_pooled.json``).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import NoReturn

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine, write_json  # noqa: E402

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
    ap.add_argument("--kv-dtype", default=None, help="the caches' storage dtype, e.g. float16 (default: the model's)")
    ap.add_argument("--query-aware", action="store_true", help="the question ends the prompt (SnapKV's window sees it)")
    ap.add_argument("--pool", type=Path, nargs="+", default=None, help="result files to pair together (no run)")
    args = ap.parse_args()
    if args.pool:
        return pool(args.pool, args.out or RESULTS / "kv_suite_pooled.json")
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, _stop)  # `kill PID` keeps the finished tasks, as Ctrl-C does
    options = {
        "model": "smollm2",
        "policies": args.policies,
        "n": args.n,
        "tokens": args.tokens,
        "seed": args.seed,
        "ppl": args.ppl,
        "continuation": args.continuation,
        "out": args.out,
        "force": not args.resume,
        "kv_dtype": args.kv_dtype,
        "query_aware": args.query_aware,
    }
    outcome = runner.run("kv-suite", options, resume=args.resume, progress=True)
    if outcome.result is None:
        return  # interrupted: the runner said where the finished tasks are
    for line in table(outcome.result.figures):
        print(line)
    write_json("kv_suite", {"args": {k: str(v) for k, v in vars(args).items()}, **outcome.result.figures})


def pool(paths: list[Path], out: Path) -> None:
    """The tasks of several finished runs (the same policies and settings but the seed, and how many tasks each ran and
    scored for perplexity), paired as one run."""
    import json

    from headlab.decode.suite_instrument import policy_texts, suite_rows

    try:  # before any work: nothing pooled is lost to a bad --out
        if out.is_dir() or not out.parent.is_dir():
            raise OSError("not a file in a folder")
        if not out.exists():
            out.touch()
            out.unlink()
    except OSError as e:
        _refuse(f"--out {out}: cannot be written ({e}); give a .json path in a writable folder")
    units_of, settings = [], []
    for p in paths:
        try:
            d = json.loads(p.read_text())
            settings.append(d["headlab"]["settings"])
            units_of.append(dict(d["units"]))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            _refuse(f"{p}: not a finished `headlab kv suite` result ({type(e).__name__}: {e})")
    for p, s in zip(paths[1:], settings[1:]):
        differ = sorted(k for k in s if k not in ("seed", "n", "ppl") and s[k] != settings[0][k])
        if differ:
            _refuse(
                f"{p}: settings {differ} differ from {paths[0]}'s; pool runs that differ by --seed, --n and --ppl only"
            )
    seeds = [s["seed"] for s in settings]
    if len(set(seeds)) != len(seeds):
        _refuse(f"the runs share a seed ({seeds}): the same tasks would count twice")
    units = [u for us in units_of for _, u in sorted(us.items(), key=lambda kv: int(kv[0].split()[-1]))]
    rows = suite_rows(policy_texts(settings[0]["policies"]), units, seed=seeds[0])
    lengths = [u["length"] for u in units]
    figures = {"rows": rows, "tasks": len(units), "lengths": [min(lengths), max(lengths)]}
    for line in table(figures):
        print(line)
    payload = {
        "machine": machine(),
        "runs": [str(p) for p in paths],
        "seeds": seeds,
        "settings": settings[0],
        **figures,
    }
    out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {out}")


def _refuse(message: str) -> NoReturn:
    """One line on stderr and exit status 2, as the command line refuses bad input."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def _stop(*_) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
