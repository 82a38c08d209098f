"""Fine-tune the bundled all-MiniLM-L6-v2 on SST-2: the classifier the saliency, flow and heads studies use.

    python benchmarks/models/minilm_sst2.py                 # trains once, then skips
    python benchmarks/models/minilm_sst2.py --force         # trains again
    python benchmarks/models/minilm_sst2.py --limit 200 --out /tmp/smoke   # a smoke run

The same as ``headlab train-classifier --data ../shared/data/sst2`` (the library's
:func:`headlab.models.finetune.train_classifier`; this script only finds the shared data and skips
when the classifier exists). It writes ``cache_dir("minilm-sst2")`` (``~/.cache/headlab/minilm-sst2``).

Measured (the defaults, seed 0, one torch thread, 2-core machine): validation accuracy 0.8853
(772/872), 1,250 steps, 23.3 min wall.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
DEFAULT_DATA = next((p for p in (HERE.parents[3] / "shared" / "data" / "sst2", Path("/work/shared/data/sst2"))
                     if (p / "train.tsv").is_file()), Path("/work/shared/data/sst2"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with train.tsv and validation.tsv")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: cache_dir('minilm-sst2'))")
    ap.add_argument("--subset", type=int, default=40000)
    ap.add_argument("--limit", type=int, default=None, help="use only the first N training rows (smoke runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="train even when the output folder exists")
    args = ap.parse_args(argv)

    from headlab.models.finetune import TrainingConfig, default_folder, train_classifier
    from headlab.progress import progress

    out = (args.out or default_folder()).expanduser()
    if (out / "config.json").is_file() and not args.force:
        info = out / "headlab-training.json"
        acc = json.loads(info.read_text()).get("validation_accuracy") if info.is_file() else None
        print(f"{out} exists (validation accuracy {acc}); skipping. Pass --force to train again.")
        return 0
    for name in ("train.tsv", "validation.tsv"):
        if not (args.data / name).is_file():
            sys.exit(f"no {args.data / name}: pass --data FOLDER holding SST-2's train.tsv and validation.tsv")
    cfg = TrainingConfig(subset=args.subset, limit=args.limit, seed=args.seed, threads=args.threads,
                         eval_every=args.eval_every)
    with progress() as bar:
        task = bar.add_task("SST-2", total=None)
        r = train_classifier(args.data / "train.tsv", args.data / "validation.tsv", out=out, config=cfg, force=True,
                             progress=lambda step, steps, loss: bar.update(task, completed=step, total=steps))
    print(f"validation accuracy {r.validation_accuracy:.4f} ({r.validation_sentences} sentences); {r.steps} steps, "
          f"training {r.train_seconds / 60:.1f} min; saved {r.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
