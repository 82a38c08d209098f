"""One rank of tests/test_tp_structure.py: ``python tp_structure_worker.py RANK WORLD PORT OUT_DIR MODELS_DIR``.

Every folder under ``MODELS_DIR`` holds a tiny model of a type headlab reads by structure; each rank loads each
with ``headlab.load(..., tensor_parallel=True)`` (read whole, checked, then cut by heads: headlab.models.tp_structure)
and saves ``OUT_DIR/rank{R}.pt``: per model, which heads it holds and how its plan was made, what its shards are
(found by value against the unsharded weights), and :func:`runs` (the same calls one process makes in the test).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tp_worker import as_rank  # noqa: E402

SITES = ["blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.attn.pattern", "blocks.*.attn.z",
         "blocks.*.attn.head_out"]


def inputs(vocab: int = 97) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (2, 10), generator=g)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


def _main(out):
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def runs(target) -> dict:
    """Outputs, captures (global head order), an edit by global head, a gate, W_V/W^O whole, head importance."""
    import headlab
    from headlab.models.tp_weights import value_path

    x = inputs()
    cap = headlab.capture(target, x, SITES)
    res = {"output": _main(cap.outputs), "captures": dict(cap)}

    def zero_3(z, site):
        z = z.clone()
        z[:, 3] = 0
        return z

    ed = headlab.capture(target, x, ["blocks.1.attn.z"], edits={"blocks.1.attn.z": zero_3})
    res["edited"] = _main(ed.outputs)
    adapter = cap.adapter
    adapter.gates[0, 1] = 0.0  # a gate by global index: lands on the rank holding head 1
    res["gated"] = _main(adapter.forward(x))
    adapter.reset_gates()
    res["value_path"] = [t for t in value_path(adapter, 1) if t is not None]
    g = torch.Generator().manual_seed(5)
    texts = [torch.randint(3, 97, (n,), generator=g) for n in (7, 9, 9, 6)]
    res["importance"] = headlab.head_importance(target, texts, batch_size=2)
    return res


def shards(loaded, reference) -> dict:
    """Per layer: the first global row (column, for W^O) of the unsharded weight each local shard equals."""
    from headlab.distributed.placement import is_dtensor

    found = {}
    for layer in range(loaded.adapter.n_layers):
        mine = [*loaded.adapter.attn_modules[layer].named_parameters(), ("out", loaded.adapter.out_projs[layer].weight)]
        theirs = dict([*reference.adapter.attn_modules[layer].named_parameters(),
                       ("out", reference.adapter.out_projs[layer].weight)])
        for name, p in mine:
            if not is_dtensor(p) or p.ndim != 2 or (p is loaded.adapter.out_projs[layer].weight and name != "out"):
                continue
            local, full = p.to_local(), theirs[name]
            axis = 1 if name == "out" else 0
            n = local.shape[axis]
            found[(layer, name)] = [i for i in range(full.shape[axis] - n + 1)
                                    if torch.equal(local, full.narrow(axis, i, n))]
    return found


def main() -> None:
    out, models, rank, world = as_rank(sys.argv)
    import torch.distributed as dist

    import headlab
    from headlab.models import tp_structure

    res = {}
    seen = []
    real = tp_structure.shard_plan
    tp_structure.shard_plan = lambda model, adapter: seen.append(real(model, adapter)[1]) or real(model, adapter)
    for path in sorted(Path(models).iterdir()):
        loaded = headlab.load(path, tensor_parallel=True)
        tp = loaded.adapter.tp
        res[path.name] = {"rank": tp.rank, "world": tp.world, "heads": list(tp.heads()),
                          "kv_heads": list(tp.kv_heads()), "by_structure": loaded.adapter.by_structure,
                          "source": seen[-1], "shards": shards(loaded, headlab.load(path)), **runs(loaded)}
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
