"""Decoding with a per-head KV cache: :func:`generate`, and :func:`perplexity` under a policy.

>>> import torch, headlab
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
...     num_key_value_heads=2, intermediate_size=64, attn_implementation="eager")).eval()
>>> prompt = torch.randint(0, 61, (1, 20))
>>> g = headlab.generate(lm, prompt, policy=headlab.kv.Policy.uniform(headlab.kv.window(sink=2, recent=6)),
...                      max_new_tokens=5)
>>> g.ids.shape, g.step_logits.shape
(torch.Size([1, 5]), torch.Size([5, 61]))
>>> g.kv_bytes   # 2 layers x 2 kv heads x 8 keys x (key + value) x head dim 8 x 4 bytes
2048
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import headlab.checks as checks
from headlab.costs.kv import kv_cache_bytes, policy_cache_bytes
from headlab.costs.model import parse_dtype
from headlab.costs.tensor_parallel import kv_cache_bytes_per_rank
from headlab.decode.cache import HeadCache
from headlab.decode.kv import check_decoder, full, kv_layout
from headlab.decode.policy import Policy
from headlab.errors import ConfigError, InputError, UnsupportedArchitectureError
from headlab.progress import Progress, reporter
from headlab.results import envelope, write_json
from headlab.spec.memory_guard import check_fits

__all__ = ["Generation", "generate", "perplexity", "prompt_ids"]


@dataclass
class Generation:
    """What :func:`generate` returns.

    Attributes:
        ids: ``(1, new)`` the generated token ids (the prompt not included).
        step_logits: ``(new, vocab)`` float32, the logits each step chose from.
        kv_bytes: the cache's key and value tensors at their peak, measured (``nbytes``; quantized rules: codes,
            scales and zero points), equal to :func:`headlab.costs.kv.policy_peak_bytes`.
        kv_bytes_full: what the ordinary (all heads full) cache holds at the same length, predicted.
        kv_bytes_per_rank: on a model sharded by tensor parallelism, each rank's cache at its peak (a kv head's keys
            and values live on the rank holding it), measured; ``kv_bytes`` is then their sum, the one-process bytes
            whenever the ranks peak at the same step (every rule that only grows: full, windows). None on one process.
        prompt_tokens: the prompt's length (the question's not included).
        question_tokens: the length of the ``question`` fed after the prompt's prefill (0: none).
        prefill_seconds: the prompt's forward; decode_seconds: the steps after it.
        text: the decoded new text (when the model came with a tokenizer).
        model: the model's name (a LoadedModel's, else its class); settings: how it was decoded (the
            envelope's header, :meth:`to_json`).
    """

    ids: torch.Tensor
    step_logits: torch.Tensor
    kv_bytes: int
    kv_bytes_full: int
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    policy: Policy
    text: str | None = None
    counts: dict = field(default_factory=dict)
    question_tokens: int = 0
    model: str | None = None
    settings: dict = field(default_factory=dict)
    kv_bytes_per_rank: list[int] | None = None  # tensor parallelism: each rank's cache (its kv heads); kv_bytes the sum

    @property
    def tokens_per_second(self) -> float:
        steps = self.ids.shape[1] - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else float("nan")

    def to_json(self) -> dict:
        """The figures in headlab's envelope (kind ``generation``), the policy nested as plain data. The step
        logits stay out (``(new, vocab)`` floats): the tokens and the cache's bytes are the result (with each
        rank's share, ``kv_bytes_per_rank``, on a model sharded by tensor parallelism; None on one process)."""
        return envelope(
            "generation",
            {
                "ids": self.ids[0].tolist(),
                "text": self.text,
                "prompt_tokens": self.prompt_tokens,
                "question_tokens": self.question_tokens,
                "kv_bytes": self.kv_bytes,
                "kv_bytes_full": self.kv_bytes_full,
                "kv_bytes_per_rank": self.kv_bytes_per_rank,
                "kv_ratio": self.kv_bytes / self.kv_bytes_full if self.kv_bytes_full else None,
                "prefill_seconds": self.prefill_seconds,
                "decode_seconds": self.decode_seconds,
                "tokens_per_second": self.tokens_per_second,
                "policy": self.policy.as_dict(),
                "heads": self.counts,
            },
            model=self.model,
            settings=self.settings,
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_json` to ``path`` (atomically; read it back with :meth:`headlab.results.Result.load`)."""
        return write_json(path, self.to_json())


def prompt_ids(adapter, loaded, prompt) -> torch.Tensor:
    """``(1, n)`` token ids from a text (the model's tokenizer) or a tensor of ids, checked."""
    if isinstance(prompt, str):
        if loaded is None or loaded.tokenizer is None:
            raise InputError(
                "a text prompt needs the model's tokenizer: pass a LoadedModel (headlab.load) or "
                "token ids of shape (1, n)"
            )
        return loaded.encode(prompt)["input_ids"]
    if not isinstance(prompt, torch.Tensor):
        raise InputError(f"prompt must be a text or a (1, n) tensor of token ids, got {type(prompt).__name__}")
    ids = prompt.unsqueeze(0) if prompt.dim() == 1 else prompt
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise InputError(f"prompt ids of shape {tuple(prompt.shape)}: give one non-empty sequence, shape (1, n)")
    if ids.dtype not in (torch.long, torch.int, torch.int32):
        raise InputError(f"prompt ids must be integers, got {ids.dtype}")
    vocab = getattr(getattr(adapter.model, "config", None), "vocab_size", None)
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise InputError(
            f"prompt ids must lie in 0..{vocab - 1} (the vocabulary); saw {int(ids.min())}..{int(ids.max())}"
        )
    return ids.long().to(next(adapter.model.parameters()).device)


def setup_decoding(model, policy):
    from headlab.models.loaded_model import resolve

    adapter, loaded = resolve(model)
    check_decoder(adapter, getattr(loaded, "name", None) or type(adapter.model).__name__)
    if not hasattr(adapter.model, "get_output_embeddings") or adapter.model.get_output_embeddings() is None:
        raise ConfigError(
            f"{type(adapter.model).__name__} has no language-model head to decode with; load the "
            "...ForCausalLM class (headlab.load does)"
        )
    policy = policy if policy is not None else Policy.uniform("full")
    if not isinstance(policy, Policy):
        raise ConfigError(
            f"policy must be a headlab.kv.Policy (e.g. kv.Policy.uniform(kv.window(4, 256))), "
            f"got {type(policy).__name__}"
        )
    kvh = kv_layout(adapter)[1]
    policy.check(kvh)
    plain = all(r == full for l, g in enumerate(kvh) for r in policy.layer_rules(l, g))
    if _own_attention(adapter) and not plain:
        raise UnsupportedArchitectureError(
            f"{type(adapter.model).__name__} computes attention in its own modules (not through transformers' "
            "attention interface), so its cache cannot be shaped per head; decode it with policy=None (the full cache)"
        )
    return adapter, loaded, policy


def _own_attention(adapter) -> bool:
    """Does the model compute attention in its own modules: a family with its own attention forward (BLOOM, Falcon)
    or modules read through their own math (:mod:`headlab.models.hf.own_bridge`), whose code reads the cache's keys
    as tensors?"""
    from headlab.models.hf.own_state import bridge_of

    return hasattr(adapter, "attention_forward") or bridge_of(adapter.model) is not None


def new_cache(adapter, policy, dtype=None):
    """A :class:`HeadCache` holding its keys and values in ``dtype`` (None: the model's); for models that compute
    attention themselves (BLOOM, Falcon, modules read through their own math), whose policy is then all full,
    transformers' own ``DynamicCache``."""
    if _own_attention(adapter):
        if dtype is not None:
            raise UnsupportedArchitectureError(
                f"{type(adapter.model).__name__} computes attention in its own modules and keeps transformers' "
                "own cache, in the model's dtype; leave kv_dtype unset"
            )
        from transformers import DynamicCache

        return DynamicCache(config=adapter.model.config)
    return HeadCache(adapter, policy, dtype=dtype)


def _held_bytes(cache) -> int:
    if isinstance(cache, HeadCache):
        return cache.peak_bytes
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (layer.keys, layer.values)
        if isinstance(t, torch.Tensor)
    )


def _limit(adapter, loaded) -> int | None:
    if loaded is not None:
        return loaded.max_positions
    return getattr(getattr(adapter.model, "config", None), "max_position_embeddings", None)


def _next(logits: torch.Tensor, *, sample: bool, temperature: float, top_k: int | None, gen) -> int:
    if not sample:
        return int(logits.argmax())
    z = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(z, min(top_k, z.numel())).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(z, -1), 1, generator=gen))


def generate(
    model,
    prompt,
    *,
    policy: Policy | None = None,
    max_new_tokens: int = 32,
    sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop_at_eos: bool = True,
    progress: bool | Progress | None = False,
    question=None,
    kv_dtype=None,
) -> Generation:
    """Decode ``max_new_tokens`` tokens after ``prompt`` with a KV cache shaped by ``policy``.

    Args:
        model: a causal LM: a LoadedModel (``headlab.load("smollm2")``), a Hugging Face model or an adapter.
        prompt: a text (needs the LoadedModel's tokenizer) or ``(1, n)`` token ids.
        policy: a :class:`~headlab.kv.Policy`; None keeps every head full (then the tokens equal Hugging
            Face's greedy ``generate``).
        max_new_tokens: how many tokens to generate (fewer when the model emits its end-of-sequence token
            and ``stop_at_eos``).
        sample, temperature, top_k, seed: sampling instead of greedy decoding, reproducible with ``seed``.
        progress: the steps' progress (:mod:`headlab.progress`): a display on stderr (True), nothing (False,
            None) or ``progress(stage, done, total)``.
        question: a text or ids fed as one more forward after the prompt's prefill, before the first new token.
            SnapKV / Ada-KV rules select from the prefill, so with ``question`` the selection does not know the
            question (query-agnostic, as kvpress evaluates: compress the context, then ask); without it, a
            question at the end of ``prompt`` lies in the observation window (SnapKV's own setting).
        kv_dtype: the dtype the cache holds keys and values in (and a quantized head its scales and zeros), when
            not the model's: ``torch.float16`` or ``"bfloat16"`` holds a 16-bit cache under a float32 model
            (:class:`~headlab.decode.HeadCache`'s ``dtype``); ``kv_bytes`` and ``kv_bytes_full`` are then counted
            at it, so their ratio is against a 16-bit full cache really held.

    The prompt runs as one forward (prefill; windowed heads on the sparse kernel), then one token per step.
    """
    adapter, loaded, policy = setup_decoding(model, policy)
    checks.positive_int("max_new_tokens", max_new_tokens)
    if sample and not temperature > 0:
        raise ConfigError(f"temperature must be > 0 for sampling, got {temperature}")
    if top_k is not None:
        checks.positive_int("top_k", top_k, what=" (the most likely tokens sampled from)")
    if seed is not None:
        checks.integer("seed", seed, hint="; give a whole number such as 0, or None")  # 'x' failed inside torch
    ids = prompt_ids(adapter, loaded, prompt)
    n = ids.shape[1]
    q_ids = prompt_ids(adapter, loaded, question) if question is not None else ids[:, :0]
    nq = q_ids.shape[1]
    limit = _limit(adapter, loaded)
    if limit is not None and n + nq + max_new_tokens > limit:
        raise InputError(
            f"the prompt ({n} tokens{f' and a {nq}-token question' if nq else ''}) plus {max_new_tokens} "
            f"new tokens exceeds the {limit} positions the model was trained for; shorten the prompt or "
            "ask for fewer tokens"
        )
    hf = adapter.model
    kvh = kv_layout(adapter)[1]
    dtype = next(hf.parameters()).dtype if kv_dtype is None else parse_dtype(kv_dtype)
    policy.check_shape(kvh, adapter.head_dim)
    predicted = policy_cache_bytes(
        policy, kv_heads=kvh, tokens=n + nq + max_new_tokens, head_dim=adapter.head_dim, dtype=dtype, prompt=n
    )
    place = adapter.placement
    if place.sharded:  # this rank holds its kv heads' share
        predicted = kv_cache_bytes_per_rank(
            policy,
            kv_heads=kvh,
            world=place.tensor_size,
            prompt=n,
            tokens=n + nq + max_new_tokens,
            head_dim=adapter.head_dim,
            dtype=dtype,
        )[place.tensor_rank]
    check_fits(
        predicted,
        what=f"the KV cache at {n + nq + max_new_tokens} tokens under {policy.name}"
        f"{f' on rank {place.tensor_rank} of {place.tensor_size}' if place.sharded else ''}",
        device=ids.device,
        alternative=None,
    )
    eos = getattr(getattr(hf, "generation_config", None), "eos_token_id", None)
    eos = set(eos if isinstance(eos, list) else [eos]) - {None} if stop_at_eos else set()
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out_ids, logits_seen = [], []
    with torch.no_grad(), adapter.use_backend("auto"):
        cache = new_cache(adapter, policy, kv_dtype)
        t0 = time.perf_counter()
        logits = hf(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        if nq:  # after the prefill (and SnapKV's selection): the question, as one more chunk
            logits = hf(input_ids=q_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        t1 = time.perf_counter()
        with reporter(progress) as say:  # the one protocol: a display of its own (True) or the caller's
            for step in range(max_new_tokens):
                logits_seen.append(logits.float())
                tok = _next(logits, sample=sample, temperature=temperature, top_k=top_k, gen=gen)
                out_ids.append(tok)
                say("decoding", step + 1, max_new_tokens)
                if tok in eos or step == max_new_tokens - 1:
                    break
                logits = hf(input_ids=torch.tensor([[tok]], device=ids.device), cache=cache, use_cache=True).logits[
                    0, -1
                ]
        t2 = time.perf_counter()
    held = n + nq + len(out_ids) - 1  # the last token is never fed back
    full_bytes = kv_cache_bytes([[held] * g for g in kvh], head_dim=adapter.head_dim, dtype=dtype)  # all kept
    new = torch.tensor([out_ids], dtype=torch.long)
    text = (
        loaded.tokenizer.decode(out_ids, skip_special_tokens=True) if loaded is not None and loaded.tokenizer else None
    )
    settings = {"policy": policy.name, "max_new_tokens": max_new_tokens, "sample": sample, "stop_at_eos": stop_at_eos}
    if sample:
        settings.update(temperature=temperature, top_k=top_k, seed=seed)
    name = getattr(loaded, "name", None) or type(hf).__name__
    kv_held, per_rank = _held_bytes(cache), None
    if place.sharded:  # every rank's cache holds its own kv heads: report each, and their sum
        from headlab.distributed.data import gather_objects

        per_rank = [int(b) for b in gather_objects(kv_held, place.group)]
        kv_held = sum(per_rank)
    return Generation(
        new,
        torch.stack(logits_seen),
        kv_held,
        full_bytes,
        n,
        t1 - t0,
        t2 - t1,
        policy,
        text,
        policy.counts(kvh),
        nq,
        name,
        settings,
        kv_bytes_per_rank=per_rank,
    )


def perplexity(
    model, ids: torch.Tensor, *, policy: Policy | None = None, chunk: int = 512, prefill: int | None = None
) -> float:
    """Perplexity of ``ids (1, n)`` under ``policy``: one forward with the policy's per-head visibility.

    Equal to decoding the text token by token under the policy (keys keep their positions), which
    the tests check; the logits are computed ``chunk`` positions at a time, so an 8k-token text does
    not hold an ``n x vocab`` matrix.

    Quantized rules (``bits`` < 16) act on the cache, not on the prefill (KIVI computes the prompt's
    attention in full precision and stores it quantized), so one forward does not see them: give
    ``prefill`` to run the first ``prefill`` tokens as one forward and the rest one token at a time, as
    decoding does (a forward per token: slower). The same holds for SnapKV / Ada-KV rules, which select from
    the prefill once it has run: with ``prefill``, the tokens after it see only what each head kept.
    """
    adapter, loaded, policy = setup_decoding(model, policy)
    ids = prompt_ids(adapter, loaded, ids)
    if ids.shape[1] < 2:
        raise InputError("perplexity needs at least 2 tokens")
    if prefill is not None:
        checks.int_in_range("prefill", prefill, 1, ids.shape[1], what=" (the tokens run as one forward)")
    hf = adapter.model
    head = hf.get_output_embeddings()
    cap = getattr(hf.config, "final_logit_softcapping", None)
    nll, count = 0.0, 0
    with torch.no_grad(), adapter.use_backend("auto"):
        cache = new_cache(adapter, policy)
        if prefill is None:
            hidden = hf.base_model(input_ids=ids, cache=cache, use_cache=True).last_hidden_state[0]  # (n, E)
        else:
            rows = [hf.base_model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).last_hidden_state[0]]
            for t in range(prefill, ids.shape[1]):
                rows.append(
                    hf.base_model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).last_hidden_state[0]
                )
            hidden = torch.cat(rows)
        for s in range(0, ids.shape[1] - 1, chunk):
            e = min(s + chunk, ids.shape[1] - 1)
            z = head(hidden[s:e]).float()
            if cap:
                z = torch.tanh(z / cap) * cap
            nll += float(torch.nn.functional.cross_entropy(z, ids[0, s + 1 : e + 1], reduction="sum"))
            count += e - s
    return float(torch.exp(torch.tensor(nll / count)))
