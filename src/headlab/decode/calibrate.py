"""Which heads a window would hurt: the attention mass a sink + window cache evicts, where an answer is read.

DuoAttention (Xiao et al. 2024) finds its retrieval heads by optimising one gate per head on synthetic
passkey prompts: a head whose output changes when its cache is cut to sinks + a recent window keeps the
full cache. :func:`window_loss` is a training-free stand-in read from the same kind of prompt: for the
last ``rows`` query positions of each prompt (where the question is asked and the answer produced), the
attention weight each head puts on the keys the rule would evict,

    loss[l, h] = mean over prompts and rows t of  sum_{j : sink <= j, t - j >= recent}  A_lh[t, j]

computed without attention maps: two log-sum-exps per row (over the evicted keys, over every visible
key) from :func:`headlab.attention_stats`, ``exp(lse_evicted - lse_all)``. Rank heads by it with
:meth:`headlab.kv.Policy.from_scores`.

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from headlab import kv
    >>> from headlab.decode.calibrate import window_loss
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...     num_key_value_heads=2, intermediate_size=64, attn_implementation="eager")).eval()
    >>> loss = window_loss(lm, [torch.randint(0, 61, (1, 50))], kv.window(2, 8), rows=4)
    >>> loss.shape, bool(((loss >= 0) & (loss <= 1)).all())
    (torch.Size([2, 4]), True)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from headlab.attention.stats import attention_stats
from headlab.decode.kv import check_decoder
from headlab.decode.policy import as_rule
from headlab.errors import ConfigError, InputError
from headlab.progress import Progress, reporter
from headlab.spec import masks

__all__ = ["window_loss"]


def window_loss(
    model, prompts: Sequence[torch.Tensor], rule, *, rows: int = 8, progress: bool | Progress = False
) -> torch.Tensor:
    """``(layers, heads)`` float64: the mean attention mass ``rule`` would evict, over the last ``rows`` rows.

    Args:
        model: a causal LM (LoadedModel, Hugging Face model or adapter).
        prompts: ``(1, n)`` token-id tensors, each longer than ``sink + recent + rows``.
        rule: the window (:func:`headlab.kv.window`) the policy would give the other heads.
        rows: how many of each prompt's last query positions to read.
        progress: a display (True), nothing (False), or ``progress(stage, done, total)`` after each prompt.
    """
    from headlab.models.loaded_model import resolve

    adapter, _ = resolve(model)
    check_decoder(adapter)
    rule = as_rule(rule)
    if rule.ring is None:  # a rule that keeps a bounded window of keys, first in first out past its sinks
        raise ConfigError(f"window_loss needs a window rule (kv.window(sink, recent)), got {rule!r}")
    if not prompts:
        raise InputError("window_loss needs at least one prompt")
    with reporter(progress) as say:
        return _window_loss(adapter, prompts, rule, rows, say)


def _window_loss(adapter, prompts, rule, rows, say) -> torch.Tensor:
    from headlab.interpret.capture import capture

    heads = adapter.layer_heads
    total = torch.zeros(len(heads), max(heads), dtype=torch.float64)
    sites = adapter.sites("q") + adapter.sites("k") + adapter.sites("stats")
    for i, ids in enumerate(prompts):
        n = ids.shape[-1]
        if n <= rule.ring + rows:
            raise InputError(
                f"prompt {i} has {n} tokens; window_loss reads rows whose evicted keys exist, so give "
                f"prompts longer than sink + recent + rows = {rule.ring + rows}"
            )
        off = n - rows
        visible = masks.as_mask(lambda b, h, qi, kv: kv <= qi + off)
        evicted = masks.as_mask(lambda b, h, qi, kv: (kv <= qi + off) & ~rule.visible(qi + off, kv))  # what it hides
        with torch.no_grad():
            cache = capture(adapter, ids.reshape(1, -1), sites, stats_kwargs={"stats": ["lse"]})
        for layer, h in enumerate(heads):
            q = cache[adapter.site_name(layer, "q")][:, :, off:].float()  # (1, H, rows, d)
            k = cache[adapter.site_name(layer, "k")].float()  # (1, Hkv, n, d)
            scale = cache.call_args.get(layer, {}).get("scale")
            everything = attention_stats(q, k, mask=visible, scale=scale, stats=["lse"]).lse
            lost = attention_stats(q, k, mask=evicted, scale=scale, stats=["lse"]).lse
            assert everything is not None and lost is not None  # asked for
            mass = torch.exp(lost - everything).nan_to_num(0.0)  # a row with nothing evicted: -inf -> 0
            total[layer, :h] += mass[0].double().mean(-1)
        say("window loss", i + 1, len(prompts))
    return total / len(prompts)
