"""One rank of the data-parallel importance test: ``python importance_worker.py RANK WORLD PORT OUT_DIR``.

Every rank builds the same tiny decoder and the same 7 texts; head_importance runs the instrument
``heads-importance`` through the study runner, which splits the batches across the ranks and hands every
rank every batch's sums: each rank checks that its grid equals rank 0's exactly (every rank returns the whole
result), and rank 0 saves the result to ``OUT_DIR/importance.pt``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from headlab.interpret.heads.importance import head_confidence, head_importance
from headlab.models.transformer import Transformer, TransformerConfig


def setup():
    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                      causal=True)).eval()
    g = torch.Generator().manual_seed(1)
    texts = [torch.randint(0, 40, (int(n),), generator=g) for n in (9, 5, 12, 7, 9, 11, 6)]
    return m, texts


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    m, texts = setup()
    imp = head_importance(m, texts, loss="lm", batch_size=2)
    conf = head_confidence(m, texts, batch_size=2)
    every = [None] * world
    dist.all_gather_object(every, imp)
    assert all(torch.equal(g, imp) for g in every), "a rank returned another importance than rank 0's"
    if rank == 0:
        torch.save({"importance": imp, "confidence": conf}, os.path.join(out, "importance.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
