"""One rank of the data-parallel heads-commands test, under ``torchrun --nproc_per_node 2 heads_dp_worker.py - - - OUT
MODEL`` (run by tests/test_heads_units.py): every rank runs ``heads importance``, ``heads ablate`` and ``heads prune
--fraction`` through the CLI's entry point on an unsharded model, so the study runner splits their units across
the ranks (importance) or runs them on the first (the ablation's and the pruning's chained units); rank 0 writes
under ``OUT/<name>``. ``commands`` is shared with the test, which runs the same commands in one process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def commands(model: str, data: Path, out: Path) -> dict[str, list[str]]:
    m = ["--model", model, "--data", str(data), "--batch-size", "2"]
    return {"importance": ["heads", "importance", *m, "--loss", "lm", "--out", str(out / "importance")],
            "ablate": ["heads", "ablate", *m, "--loss", "lm", "--k", "3", "--boot", "50", "--out", str(out / "ablate")],
            "prune": ["heads", "prune", *m, "--fraction", "0.25", "--curve", "--recompute", "--out", str(out / "prune")]}


def main() -> None:
    out, model = Path(sys.argv[4]), sys.argv[5]
    from headlab.cli.main import main as headlab

    codes = {}
    for name, args in commands(model, Path(model).parent / "ids.txt", out).items():
        try:
            headlab(args)
            codes[name] = 0
        except SystemExit as e:
            codes[name] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    import torch
    import torch.distributed as dist

    torch.save(codes, os.path.join(out, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
