"""One canonical view of a transformer: :class:`ModelAdapter`.

Whatever the model came from (BERT, GPT-2, Llama, headlab's own :class:`~headlab.models.transformer.Transformer`),
its adapter answers the same questions in the same shapes:

    n_layers, n_heads (query heads H), n_kv_heads (Hkv), head_dim (d), d_model (E), causal
    W_Q(layer) (H, E, d)    W_K(layer), W_V(layer) (Hkv, E, d)    W_O(layer) (H, d, E)
    b_Q(layer) (H, d)       b_K(layer), b_V(layer) (Hkv, d)       b_O(layer) (E,)      (or None)
    gates (n_layers, H)     multiplies head h's output z_h before W^O (1 = untouched, 0 = ablated)

Every attention layer runs through :func:`~headlab.models.sites.run_attention`, the one place where
q, k, v (after any rotary embedding, as the scores see them), the mask and the backend meet. The
adapter keeps a :class:`~headlab.models.sites.LayerState` on each attention module (its layer index,
the backend chosen with :meth:`ModelAdapter.use_backend`, the active edits and capture) and two
hooks on each output projection (W^O): a pre-hook that applies the gates to the per-head outputs z,
and a hook that reports the per-head contributions ``head_out[h] = z_h W_O[h]``. The sites and what
each holds are listed in :mod:`headlab.models.sites`; setting the backend, edits and capture for a block is
:class:`~headlab.models.controls.LayerControls`'s.

Gates act on z, not on the attention probabilities, so they work on every backend, fused ones
included (Hugging Face's old ``head_mask`` scaled probabilities and only worked on the eager path).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from headlab.distributed.placement import Placement
from headlab.errors import ConfigError, InputError, PruneError, UnsupportedArchitectureError
from headlab.models import tensor_parallel as _tp  # a model sharded by tensor parallelism: its heads per rank
from headlab.models.controls import LayerControls
from headlab.models.norm_layout import BlockNorms
from headlab.models.projections import Out
from headlab.models.sites import SITE_KINDS, LayerState, default_prefixes, gate_hook, head_out_hook


class ModelAdapter(LayerControls):
    """The canonical view of one transformer (see the module docstring for the shapes).

    Subclasses (one per family) say where the attention modules and output projections are and how
    their weights split into heads. Build one with :func:`headlab.models.adapt`, which caches it on
    the model (adapting twice returns the same adapter).

        >>> import torch
        >>> from headlab.models import adapt
        >>> from headlab.models.transformer import Transformer, TransformerConfig
        >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4))
        >>> a = adapt(m)
        >>> a.family, a.n_layers, a.n_heads, a.head_dim, a.W_Q(0).shape, a.W_O(1).shape
        ('headlab', 2, 4, 8, torch.Size([4, 32, 8]), torch.Size([4, 8, 32]))
        >>> a.gates.shape
        torch.Size([2, 4])
        >>> a.hook_sites()[:3]
        ['blocks.0.attn.q', 'blocks.0.attn.k', 'blocks.0.attn.v']
    """

    family: ClassVar[str] = "?"
    is_decoder: ClassVar[bool] = False  # families whose tokens see only earlier tokens say True
    own_model: ClassVar[bool] = False  # headlab's own Transformer: called with an ids tensor, saved in its format
    _placement: Placement | None = None  # sharded by heads: read from the weights in __init__ (models.tensor_parallel)
    placement = property(
        lambda self: self._placement or Placement.here(self.n_heads, self.n_kv_heads),
        doc="Which rank holds which heads and runs which units (headlab.distributed.placement)",
    )
    tp = property(
        lambda self: self._placement.group_view() if self._placement else None,
        doc="The tensor-parallel group's placement (rank and world within it); None when not sharded",
    )

    def __init__(
        self,
        model: nn.Module,
        *,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        d_model: int,
        attn_modules: list[nn.Module],
        out_projs: list[nn.Module],
    ) -> None:
        if not (len(attn_modules) == len(out_projs) == n_layers):
            raise ConfigError(
                f"adapter for {type(model).__name__}: found {len(attn_modules)} attention modules and "
                f"{len(out_projs)} output projections for {n_layers} layers"
            )
        self.model, self.n_layers, self.n_heads, self.n_kv_heads = model, n_layers, n_heads, n_kv_heads
        self.head_dim, self.d_model = head_dim, d_model
        self.attn_modules, self.out_projs = list(attn_modules), list(out_projs)
        p = next(model.parameters(), None)
        self._gates = torch.ones(n_layers, n_heads, device=p.device if p is not None else None)
        self._handles: list = []
        # one state per layer, reachable from the layer's attention module and its output projection
        self.site_prefixes = self._site_prefixes()
        self._placement = _tp.placement_of(model, self)  # a Placement, or None (headlab.models.tensor_parallel)
        local = self._placement.local_heads if self._placement else n_heads  # sharded: W^O's input holds H/world heads
        self.states = [
            LayerState(layer=i, n_heads=local, head_dim=head_dim, adapter=self, site=self.site_prefixes[i])
            for i in range(n_layers)
        ]
        self._attach_states()

    def _attach_states(self) -> None:
        """Put each layer's state on its modules and hook W^O. A module that serves several layers (ALBERT
        shares one block across all of them) gets the state of the layer it is about to compute: a
        pre-hook on the attention module takes the next of its layers, a pre-hook on the model rewinds."""
        hooked: set[int] = set()
        gate, out = _tp.hooks_for(self) or (gate_hook, head_out_hook)  # a sharded W^O: this rank's heads only
        for i, (am, op) in enumerate(zip(self.attn_modules, self.out_projs)):
            if id(op) in hooked:
                continue
            hooked.add(id(op))
            am._headlab = op._headlab = self.states[i]  # type: ignore[assignment]  # torch types module attributes Tensor | Module
            self._handles.append(op.register_forward_pre_hook(gate))
            self._handles.append(op.register_forward_hook(out))
        shared = self.shared_layers
        if not shared:
            return
        calls: dict[int, int] = {}

        def rewind(module, args):
            calls.clear()

        def next_layer(am, op, layers):
            def hook(module, args, kwargs):
                k = calls.get(id(am), 0)
                calls[id(am)] = k + 1
                am._headlab = op._headlab = self.states[layers[k % len(layers)]]

            return hook

        self._handles.append(self.model.register_forward_pre_hook(rewind))
        for layers in shared:
            am, op = self.attn_modules[layers[0]], self.out_projs[layers[0]]
            self._handles.append(am.register_forward_pre_hook(next_layer(am, op, layers), with_kwargs=True))

    def _site_prefixes(self) -> list[str]:
        """The site prefix of every attention layer (single stack: ``blocks.{i}.attn``)."""
        return default_prefixes(self.n_layers)

    @property
    def stacks(self) -> dict[str, list[int]]:
        """Layer indices of each stack: ``{"blocks": [...]}`` for one stack; an encoder-decoder has
        ``"encoder"``, ``"decoder"`` (self-attention) and ``"cross"``."""
        return {"blocks": list(range(self.n_layers))}

    def site_name(self, layer: int, kind: str) -> str:
        """The name of site ``kind`` of attention layer ``layer``: ``blocks.3.attn.pattern``, ``decoder.1.cross.z``."""
        return f"{self.site_prefixes[layer]}.{kind}"

    def sites(self, kind: str) -> list[str]:
        """Globs that match site ``kind`` in every layer of every stack (``["blocks.*.attn.pattern"]``)."""
        return sorted({".".join([p.split(".")[0], "*", p.split(".")[2], kind]) for p in self.site_prefixes})

    def hook_sites(self) -> list[str]:
        """Every site a capture can ask for, layer by layer: ``blocks.{l}.attn.{q,k,v,pattern,z,head_out,stats}``."""
        return [self.site_name(i, kind) for i in range(self.n_layers) for kind in SITE_KINDS]

    @property
    def shared_layers(self) -> list[list[int]]:
        """Groups of layers computed by one shared module (ALBERT); empty when every layer has its own."""
        serves: dict[int, list[int]] = {}
        for i, am in enumerate(self.attn_modules):
            serves.setdefault(id(am), []).append(i)
        return [v for v in serves.values() if len(v) > 1]

    @property
    def layer_heads(self) -> list[int]:
        """Query heads of every layer: ``[n_heads] * n_layers`` unless the model was pruned (then
        layers may differ, and ``n_heads`` is the largest count)."""
        return [self.n_heads] * self.n_layers

    @property
    def layer_kv_heads(self) -> list[int]:
        """Key/value heads of every layer (see :attr:`layer_heads`)."""
        return [self.n_kv_heads] * self.n_layers

    @property
    def has_task_head(self) -> bool:
        """Whether the model ends in a task head with logits (a classifier or a language-model head)."""
        from headlab.models.inputs import has_lm_head

        return (
            self.own_model
            or type(self.model).__name__.endswith(
                ("ForSequenceClassification", "LMHeadModel", "ForCausalLM", "ForConditionalGeneration")
            )
            or has_lm_head(self.model)
        )

    def value_input(self, layer: int, args: tuple, kwargs: dict) -> torch.Tensor:
        """The tensor layer ``layer``'s keys and values are computed from, out of its attention module's call
        arguments: the module's input (``hidden_states``); an encoder-decoder's cross-attention says otherwise."""
        return args[0] if args else kwargs.get("hidden_states")  # type: ignore[return-value]  # every attention module is given them

    @property
    def causal(self) -> bool:
        """True when each token attends only to itself and earlier tokens (a decoder)."""
        return self.is_decoder

    def attention_norm(self, layer: int) -> BlockNorms:
        """The normalisation around block ``layer``'s attention (:class:`~headlab.models.norm_layout.BlockNorms`:
        pre, post, sandwich or parallel; LayerNorm or RMSNorm)."""
        raise UnsupportedArchitectureError(
            f"the {self.family!r} adapter does not say where its block's normalisation is (attention_norm)"
        )

    def block(self, layer: int) -> nn.Module:
        """The block (transformer layer) holding attention layer ``layer``: the item of the model's layer list on
        the attention module's path (``model.layers.3`` for ``model.layers.3.self_attn``). The residual sites
        ``resid_pre`` (its input), ``resid_post`` (its output) and ``mlp_out`` hook it; one stack, unshared only."""
        layer = self._check_layer(layer)
        if set(self.stacks) != {"blocks"} or self.shared_layers:
            raise UnsupportedArchitectureError(
                f"residual-stream sites need one stack of unshared blocks; the {self.family!r} model has stacks "
                f"{', '.join(self.stacks)}{' and shares blocks across layers' if self.shared_layers else ''}"
            )
        path = next((p for p, m in self.model.named_modules() if m is self.attn_modules[layer]), "")
        parts = path.split(".")
        cut = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if cut is None:
            raise UnsupportedArchitectureError(
                f"the {self.family!r} model keeps attention at {path!r}, not in a "
                "list of blocks: residual-stream sites cannot find the block"
            )
        return self.model.get_submodule(".".join(parts[: cut + 1]))

    def mlp(self, layer: int) -> nn.Module:
        """Block ``layer``'s MLP: its child ``mlp``, ``ffn``, ``feed_forward`` (an MoE's ``block_sparse_moe``, ``moe``),
        called on one tensor (the site ``mlp_out`` is its output). Families whose MLP adds the residual itself
        (BLOOM) or that keep the MLP as loose layers (BERT, OPT) have none: :class:`UnsupportedArchitectureError`."""
        import inspect

        block = self.block(layer)
        for name in ("mlp", "ffn", "feed_forward", "block_sparse_moe", "moe"):  # MoE blocks: the router is the MLP
            m = block._modules.get(name)
            if m is None:
                continue
            params = inspect.signature(m.forward).parameters.values()
            required = [
                p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            if len(required) == 1:
                return m
        raise UnsupportedArchitectureError(
            f"the {self.family!r} block has no MLP module called on the stream alone (children: "
            f"{', '.join(block._modules)}): the site mlp_out is not available"
        )

    # -- physical head removal: each family says how (headlab.models.surgery asks) -----------------------------
    def cut_heads(
        self, attn: nn.Module, out: nn.Module, q_heads: list[int], kv_heads: list[int], H: int, Hkv: int
    ) -> None:
        """Keep query heads ``q_heads`` and kv heads ``kv_heads`` of one layer's modules (H, Hkv before), in place."""
        raise PruneError(f"the {self.family!r} adapter cannot remove heads physically (cut_heads)")

    def zero_heads(self, out: nn.Module, local_heads: list[int], *, H: int) -> None:
        """Set the W^O blocks of ``local_heads`` (indices in the layer as it is now, H heads) to zero."""
        Out("").zero(out, local_heads, self.head_dim)  # an nn.Linear W^O; families with another layout override

    def prune_config(self, config, H: int, Hkv: int) -> bool:
        """Write uniform head counts into the model's config when it can say them; True when it did."""
        return False

    # -- per-head weights: families override the _w/_b accessors -----------------------------------
    def W_Q(self, layer: int) -> torch.Tensor:
        """``(H, E, d)``: ``x @ W_Q(l)[h] + b_Q(l)[h]`` is head h's query (before any rotary embedding)."""
        return self._weights(self._check_layer(layer), "q")

    def W_K(self, layer: int) -> torch.Tensor:
        """``(Hkv, E, d)``; query head h reads kv head ``h // (H // Hkv)``."""
        return self._weights(self._check_layer(layer), "k")

    def W_V(self, layer: int) -> torch.Tensor:
        """``(Hkv, E, d)``."""
        return self._weights(self._check_layer(layer), "v")

    def W_O(self, layer: int) -> torch.Tensor:
        """``(H, d, E)``: head h's block of the output projection: ``head_out[h] = z_h @ W_O(l)[h]``."""
        return self._weights(self._check_layer(layer), "o")

    def b_Q(self, layer: int) -> torch.Tensor | None:
        """``(H, d)`` or None."""
        return self._bias(self._check_layer(layer), "q")

    def b_K(self, layer: int) -> torch.Tensor | None:
        """``(Hkv, d)`` or None."""
        return self._bias(self._check_layer(layer), "k")

    def b_V(self, layer: int) -> torch.Tensor | None:
        """``(Hkv, d)`` or None."""
        return self._bias(self._check_layer(layer), "v")

    def b_O(self, layer: int) -> torch.Tensor | None:
        """``(E,)`` or None: added once, after the heads are summed."""
        return self._bias(self._check_layer(layer), "o")

    def _weights(self, layer: int, which: str) -> torch.Tensor:
        raise NotImplementedError

    def _bias(self, layer: int, which: str) -> torch.Tensor | None:
        raise NotImplementedError

    def _check_layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise ConfigError(
                f"layer {layer!r} out of range: the model has {self.n_layers} layers (0..{self.n_layers - 1})"
            )
        return layer

    # -- gates ----------------------------------------------------------------------------------------
    @property
    def gates(self) -> torch.Tensor:
        """``(n_layers, n_heads)``, default ones: head h of layer l contributes ``gates[l, h] * z_h W_O[h]``.

        Edit in place (``adapter.gates[2, 5] = 0``) or assign a new tensor of the same shape; call
        ``adapter.gates.requires_grad_(True)`` to take gradients with respect to the gates."""
        return self._gates

    @gates.setter
    def gates(self, value: torch.Tensor) -> None:
        value = torch.as_tensor(value)
        if tuple(value.shape) != (self.n_layers, self.n_heads):
            raise ConfigError(
                f"gates must have shape (n_layers, n_heads) = {(self.n_layers, self.n_heads)}, got {tuple(value.shape)}"
            )
        if not value.is_floating_point():
            value = value.float()
        self._gates = value.to(self._gates.device)

    def reset_gates(self) -> None:
        """All gates back to 1 (a fresh tensor, not requiring grad)."""
        self._gates = torch.ones_like(self._gates, requires_grad=False)

    def forward(self, inputs):
        """Run the wrapped model on ``inputs`` (a dict of keyword tensors, or an input-id tensor).

        A Hugging Face model gets what it still needs (:func:`headlab.models.inputs.complete_inputs`): an
        encoder-decoder given encoder ids is teacher-forced on them shifted right; a model that takes pixels or
        audio given token ids is an :class:`~headlab.errors.InputError` naming its input.

        Ids not integers or outside the vocabulary: :class:`~headlab.errors.InputError` (not torch's IndexError)."""
        self._check_ids(inputs.get("input_ids") if isinstance(inputs, dict) else inputs, isinstance(inputs, dict))
        if not self.own_model and hasattr(self.model, "config"):  # a Hugging Face model: the inputs it takes
            from headlab.models.inputs import complete_inputs

            inputs = complete_inputs(self.model, inputs if isinstance(inputs, dict) else {"input_ids": inputs})
        if isinstance(inputs, dict):
            return self.model(**inputs)
        return self.model(inputs)

    def _check_ids(self, ids, named: bool = True) -> None:
        """Integer ids in the vocabulary; a bare float tensor for a Hugging Face model may be pixels (not refused)."""
        if not isinstance(ids, torch.Tensor) or ids.numel() == 0:
            return
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            if named or self.own_model:
                raise InputError(
                    f"token ids must be an integer tensor, got dtype {ids.dtype}; convert them with "
                    ".long(), or encode text with the model's own tokenizer (loaded.encode(text))"
                )
            return
        from headlab.models.inputs import input_embeddings  # None for a model without one (audio)

        if (n := getattr(input_embeddings(self.model), "num_embeddings", None)) is None:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise InputError(
                f"token id {bad} is outside the vocabulary of {n} tokens (ids 0..{n - 1}); encode text "
                "with the model's own tokenizer (loaded.encode(text))"
            )

    def close(self) -> None:
        """Remove the adapter's hooks and state from the model (the gates stop acting)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in (*self.attn_modules, *self.out_projs):
            if hasattr(m, "_headlab"):
                del m._headlab
        if getattr(self.model, "_headlab_adapter", None) is self:
            del self.model._headlab_adapter

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} family={self.family!r} layers={self.n_layers} heads={self.n_heads} "
            f"kv_heads={self.n_kv_heads} head_dim={self.head_dim} d_model={self.d_model}>"
        )
