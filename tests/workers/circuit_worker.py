"""One rank of the circuit command under ``torchrun --nproc_per_node N circuit_worker.py - - - OUT MODEL`` (run by
tests/test_row_circuit.py): every rank runs ``headlab circuit`` through the CLI's entry point, the scoring splits
the pairs across the ranks, rank 0 writes ``OUT/circuit/``; each rank saves its exit code to ``OUT/rank{r}.pt``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ARGS = ["--task", "induction", "--pairs", "5", "--steps", "2", "--edges", "20%", "--random", "1"]


def main() -> None:
    out, model = Path(sys.argv[4]), sys.argv[5]
    from headlab.cli.main import main as headlab

    try:
        headlab(["circuit", "--model", model, *ARGS, "--out", str(out / "circuit")])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.save({"code": code}, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
