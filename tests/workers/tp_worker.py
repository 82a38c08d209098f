"""One rank of the tensor-parallel tests: ``python tp_worker.py RANK WORLD PORT OUT_DIR MODEL_DIR``, or under
``torchrun --nproc_per_node N tp_worker.py - - - OUT_DIR MODEL_DIR``.

Set up as torchrun sets a rank up (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): ``headlab.load(...,
tensor_parallel=True)`` lets transformers start the gloo group and shard the model with its plan. Each rank saves
``OUT_DIR/rank{R}.pt``: the shard layout it found on the weights, its captures (global head order), the captures
gathered to rank 0 and kept sharded, the instruments (importance, confidence, ablation, exact patching) and, for
the path where the user shards the model with transformers and headlab only adapts it, the captures again.
"""

from __future__ import annotations

import os
import sys

import torch

SITES = ["blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.attn.pattern", "blocks.*.attn.z",
         "blocks.*.attn.head_out", "blocks.*.resid_post"]


def inputs() -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


def zero_head(head: int):
    """An edit in global head order: zero head ``head``'s z."""
    def edit(z, site):
        z = z.clone()
        z[:, head] = 0
        return z
    return edit


def runs(target) -> dict:
    """Every capture the test compares with one process (the same calls, in the same order, on every rank)."""
    import headlab

    x = inputs()
    plain = headlab.capture(target, x, SITES)
    out = {"plain": dict(plain), "logits": plain.outputs.logits}
    st = headlab.capture(target, x, ["blocks.*.attn.stats"])
    out["stats"] = {k: v.as_dict() for k, v in st.items()}
    ed = headlab.capture(target, x, ["blocks.1.attn.z", "blocks.1.attn.head_out"], edits={"blocks.1.attn.z": zero_head(3)})
    out["edited"] = dict(ed)
    out["edited_logits"] = ed.outputs.logits
    adapter = headlab.capture(target, x, ["blocks.0.attn.z"]).adapter
    adapter.gates[0, 2] = 0.0  # a gate addressed by global index: lands on the rank holding head 2
    out["gated_logits"] = adapter.forward(x).logits
    adapter.reset_gates()
    return out


def gathers(target) -> dict:
    """The captures of :func:`runs` gathered to rank 0 alone, and kept sharded with their global head indices."""
    import headlab

    x = inputs()
    sites = SITES + ["blocks.*.attn.stats"]
    to0 = headlab.capture(target, x, sites, gather="rank0")
    kept = headlab.capture(target, x, sites, gather="none")
    return {"rank0": {k: v.as_dict() if k.endswith("stats") else v for k, v in to0.items()},
            "none": {k: (v.as_dict() if k.endswith("stats") else v, None if "resid" in k else list(kept.heads(k)))
                     for k, v in kept.items()}}


def instruments(target) -> dict:
    """Every instrument the test compares with one process, on token-id texts of mixed lengths (padded batches)."""
    import headlab
    from headlab.interpret.heads.importance import head_confidence
    from headlab.interpret.patching import logit_diff

    g = torch.Generator().manual_seed(5)
    texts = [torch.randint(0, 64, (n,), generator=g) for n in (7, 11, 11, 9)]
    out = {"importance": headlab.head_importance(target, texts, loss="lm", batch_size=2),
           "importance_kl": headlab.head_importance(target, texts, loss="kl", batch_size=2, seed=1),
           "confidence": head_confidence(target, texts, batch_size=2)}
    for kind in ("zero", "mean", "resample", "uniform"):
        r = headlab.ablate(target, texts, kind=kind, loss="lm", batch_size=2, n_boot=20, k=3, max_rows=16,
                           keep_one=kind == "zero", cka=kind == "zero")
        out[f"ablate_{kind}"] = {"single": r.single, "pair_effect": r.pair_effect, "baseline": torch.tensor(r.baseline),
                                 **({"keep_one": r.keep_one, "cka": r.cka} if kind == "zero" else {})}
    clean = torch.randint(0, 64, (2, 8), generator=g)
    corrupt = clean.clone()
    corrupt[:, 3] = (corrupt[:, 3] + 7) % 64
    p = headlab.patch(target, clean, corrupt, logit_diff(4, 9), sites=["z", "q", "k", "v", "pattern", "resid_post"],
                      max_rows=16)
    out["patch"] = p.raw
    p = headlab.patch(target, clean, corrupt, logit_diff(4, 9), sites="z", positions=[2, 3, 7], max_rows=16)
    out["patch_positions"] = {"z": p.raw["z"]}
    st = headlab.capture(target, inputs(), ["blocks.*.attn.stats"],
                         stats_kwargs={"key_positions": [0, 3], "query_rows": [2, 11], "method": "tiled"})
    out["stats_kwargs"] = {k: v.as_dict() for k, v in st.items()}
    return out


def layout(loaded, reference) -> dict:
    """Which global rows/columns of the unsharded weights this rank's shards equal (found by value)."""
    d = loaded.adapter.head_dim
    found = {}
    for layer in range(loaded.adapter.n_layers):
        am, ref = loaded.adapter.attn_modules[layer], reference.adapter.attn_modules[layer]
        for name in ("q_proj", "k_proj", "v_proj"):
            local = getattr(am, name).weight.to_local()
            full = getattr(ref, name).weight
            n = local.shape[0] // d
            found[(layer, name)] = [h for h in range(full.shape[0] // d - n + 1)
                                    if torch.equal(local, full[h * d:(h + n) * d])]
        local = loaded.adapter.out_projs[layer].weight.to_local()
        full = reference.adapter.out_projs[layer].weight
        n = local.shape[1] // d
        found[(layer, "o_proj")] = [h for h in range(full.shape[1] // d - n + 1)
                                    if torch.equal(local, full[:, h * d:(h + n) * d])]
    return found


def as_rank(argv: list[str]) -> tuple[str, str, int, int]:
    """``RANK WORLD PORT OUT MODEL`` (``- - -`` under torchrun): set up what torchrun would when the test launched
    the process itself; returns ``(out, model_dir, rank, world)``. Every tensor-parallel worker starts here."""
    out, model_dir = argv[4], argv[5]
    if argv[1] != "-":
        rank, world = int(argv[1]), int(argv[2])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=argv[3])
    torch.set_num_threads(1)
    return out, model_dir, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def main() -> None:
    out, model_dir, rank, world = as_rank(sys.argv)
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import headlab

    loaded = headlab.load(model_dir, tensor_parallel=True)  # transformers starts the group, as under torchrun
    tp = loaded.adapter.tp
    res = {"rank": tp.rank, "world": tp.world, "heads": list(tp.heads()), "kv_heads": list(tp.kv_heads()),
           "n_heads": loaded.adapter.n_heads, "gates": tuple(loaded.adapter.gates.shape),
           "layout": layout(loaded, headlab.load(model_dir)), "load": runs(loaded), "gathers": gathers(loaded),
           "instruments": instruments(loaded)}
    # the user shards the model with transformers; headlab adapts it as it is
    mine = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                distributed_config=DistributedConfig(tp_plan="auto", tp_size=world))
    res["adapt"] = runs(mine.eval())
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
