"""One rank of the command-line tensor-parallel test, under ``torchrun --nproc_per_node N tp_cli_worker.py - - - OUT
MODEL`` (run by tests/test_tensor_parallel_cli.py): every rank runs the same ``headlab`` commands with
``--tensor-parallel`` through the CLI's own entry point, as ``torchrun -m headlab ... --tensor-parallel`` does, one
after the other in one process group; rank 0 writes each command's files under ``OUT/<name>/``. ``commands`` is
shared with the test, which runs the same commands in one process without ``--tensor-parallel`` and compares the
files.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TEXT = "the cat sat on the mat and the dog saw the cat"
WORDS = sorted(set(TEXT.split()) | {"a", "bird", "ran", "to", "park"})

TREEBANK = """# sent_id = 1
# text = the cat sat on the mat
1\tthe\tthe\tDET\tDT\t_\t2\tdet\t_\t_
2\tcat\tcat\tNOUN\tNN\t_\t3\tnsubj\t_\t_
3\tsat\tsit\tVERB\tVBD\t_\t0\troot\t_\t_
4\ton\ton\tADP\tIN\t_\t6\tcase\t_\t_
5\tthe\tthe\tDET\tDT\t_\t6\tdet\t_\t_
6\tmat\tmat\tNOUN\tNN\t_\t3\tobl\t_\t_

# sent_id = 2
# text = a bird saw the dog
1\ta\ta\tDET\tDT\t_\t2\tdet\t_\t_
2\tbird\tbird\tNOUN\tNN\t_\t3\tnsubj\t_\t_
3\tsaw\tsee\tVERB\tVBD\t_\t0\troot\t_\t_
4\tthe\tthe\tDET\tDT\t_\t5\tdet\t_\t_
5\tdog\tdog\tNOUN\tNN\t_\t3\tobj\t_\t_

"""


def inputs(folder: Path) -> dict[str, Path]:
    """The commands' input files, written into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"texts": folder / "texts.txt", "tsv": folder / "d.tsv", "treebank": folder / "tb.conllu"}
    files["texts"].write_text("the cat sat on the mat\nthe dog ran to the park\na bird saw the cat\n")
    files["tsv"].write_text("sentence\tlabel\nthe cat sat on the mat\t1\n")
    files["treebank"].write_text(TREEBANK)
    return files


def commands(model: str, out: Path, files: dict[str, Path]) -> dict[str, list[str]]:
    """``{name: headlab arguments}``, each writing under ``out / name``."""
    m = ["--model", model]
    return {
        "analyze": ["analyze", TEXT, *m, "--out", str(out / "analyze")],
        "flow": ["flow", TEXT, "--method", "norms", *m, "--out", str(out / "flow")],
        "importance": ["heads", "importance", "--data", str(files["texts"]), "--batch-size", "2", *m,
                       "--out", str(out / "importance")],
        "probe": ["probe", "-t", str(files["treebank"]), *m, "--out", str(out / "probe")],
        "patch": ["patch", "--clean", "the cat sat on the", "--corrupted", "the dog sat on the", "--answer", "mat",
                  "--wrong", "park", "--method", "both", *m, "--out", str(out / "patch.json")],
        "generate": ["generate", "the cat sat on", "--max-new-tokens", "5", "--policy", "streaming:1,2", *m,
                     "--out", str(out / "generate.json")],
        "explain": ["explain", "--dataset", str(files["tsv"]), "--methods", "attention,gradient,grad_x_input,"
                    "rollout", *m, "--out", str(out / "explain")],
    }


def main() -> None:
    out, model = Path(sys.argv[4]), sys.argv[5]
    from headlab.cli.main import main as headlab

    files = inputs(out / f"inputs{os.environ.get('RANK', 0)}")  # each rank its own copy
    codes = {}
    for name, args in commands(model, out, files).items():
        try:
            headlab([*args, "--tensor-parallel"])
            codes[name] = 0
        except SystemExit as e:
            codes[name] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.save(codes, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
