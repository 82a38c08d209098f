"""One rank of the tensor-parallel atlas and patching tests: ``python tp_atlas_worker.py RANK WORLD PORT OUT_DIR
MODEL_DIR``, or under ``torchrun --nproc_per_node N tp_atlas_worker.py - - - OUT_DIR MODEL_DIR``.

Set up as torchrun sets a rank up (as tests/workers/tp_worker.py): ``headlab.load(..., tensor_parallel=True)``
lets transformers start the gloo group and shard the model with its plan. Each rank saves ``OUT_DIR/rank{R}.pt``:
:func:`instruments` on the sharded model (the atlas with its causal checks, path patching into the logits and
into receivers' q, k and v, attribution patching of every head site, whole and per position, and the gradients
of the residual stream under the sharded backward). The test runs :func:`instruments` on the unsharded model in
its own process and compares.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_worker  # noqa: E402

VOCAB = 64  # tests/test_tensor_parallel.py's tiny_llama


def atlas_settings() -> dict:
    """Small enough for a test, large enough that every kind is scored and every check has its draws."""
    return dict(texts=[[(7 * i) % 61 + 1 for i in range(150)]], k=2, n_draws=10, half=7, n_repeated=3,
                max_tokens=24, n_texts=3, needle_trials=3, haystack_tokens=30, n_boot=200, max_rows=16)


def pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Clean prompts and their corrupted twins (one token changed)."""
    g = torch.Generator().manual_seed(11)
    clean = torch.randint(0, VOCAB, (2, 8), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2] = (corrupt[:, 2] + 5) % VOCAB
    corrupt[:, 5] = (corrupt[:, 5] + 9) % VOCAB
    return clean, corrupt


def residual_grads(target) -> dict:
    """``d scalar / d resid_pre`` of every layer, taken with a hook that keeps the residual stream in the graph:
    the gradient that reaches layer 0 has crossed every sharded attention and MLP backward, so it is the
    whole gradient only if the backward all-reduces what each rank's heads contribute."""
    from headlab.models.loader import resolve

    adapter, _ = resolve(target)
    clean, _ = pair()
    kept = {}

    def keep(layer):
        def edit(t, site):
            kept[layer] = t
            return t
        return edit

    with torch.enable_grad(), adapter.hooks({adapter.site_name(l, "resid_pre"): keep(l)
                                             for l in range(adapter.n_layers)}):
        out = adapter.forward({"input_ids": clean, "attention_mask": torch.ones_like(clean)})
        value = (out.logits[:, -1, 3] - out.logits[:, -1, 7]).sum()
        grads = torch.autograd.grad(value, [kept[l] for l in range(adapter.n_layers)])
    return {f"resid_pre{l}": g.detach() for l, g in enumerate(grads)}


def instruments(target) -> dict:
    """Every instrument the test compares with one process (the same calls, in the same order, on every rank)."""
    import headlab
    from headlab.interpret.patching import attribution_patch, logit_diff, path_patch

    out = {"atlas": headlab.atlas(target, **atlas_settings()).to_json()}
    clean, corrupt = pair()
    metric = logit_diff(4, 9)
    out["path_logits"] = path_patch(target, clean, corrupt, metric, max_rows=8).raw["z"]
    out["path_q"] = path_patch(target, clean, corrupt, metric, receivers=[(1, 0), (1, 3)], receiver_input="q",
                               max_rows=8).raw["z"]
    out["path_kv"] = path_patch(target, clean, corrupt, metric, receivers=[(1, 2)], receiver_input=["k", "v"],
                                senders=[(0, 0), (0, 1), (0, 3)], max_rows=8).raw["z"]
    a = attribution_patch(target, clean, corrupt, metric, sites=["z", "q", "k", "v", "pattern"])
    out["attribution"] = {**a.raw, "clean": torch.tensor(a.clean), "corrupted": torch.tensor(a.corrupted)}
    out["attribution_positions"] = attribution_patch(target, clean, corrupt, metric, sites="z", positions=[1, 2, 7]).raw
    out["residual_grads"] = residual_grads(target)
    return out


def main() -> None:
    out, model_dir, rank, _ = tp_worker.as_rank(sys.argv)
    import torch.distributed as dist

    import headlab

    loaded = headlab.load(model_dir, tensor_parallel=True)  # transformers starts the group, as under torchrun
    res = {"rank": loaded.adapter.tp.rank, "world": loaded.adapter.tp.world, "instruments": instruments(loaded)}
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
