"""One canonical view of a transformer: :class:`ModelAdapter`.

Whatever the model came from (BERT, GPT-2, Llama, headlab's own :class:`~headlab.models.transformer.Transformer`),
its adapter answers the same questions in the same shapes:

    n_layers, n_heads (query heads H), n_kv_heads (Hkv), head_dim (d), d_model (E)
    W_Q(layer) (H, E, d)    W_K(layer), W_V(layer) (Hkv, E, d)    W_O(layer) (H, d, E)
    b_Q(layer) (H, d)       b_K(layer), b_V(layer) (Hkv, d)       b_O(layer) (E,)      (or None)
    gates (n_layers, H)     multiplies head h's output z_h before W^O (1 = untouched, 0 = ablated)

Every attention layer runs through :func:`run_attention`, the one place where q, k, v (after any
rotary embedding, as the scores see them), the mask and the backend meet. The adapter keeps a small
:class:`LayerState` on each attention module (its layer index, the backend chosen with
:meth:`ModelAdapter.use_backend`, and the active capture probe, if any) and two hooks on each output
projection (W^O): a pre-hook that applies the gates to the per-head outputs z, and a hook that
reports z and the per-head contributions ``head_out[h] = z_h W_O[h]`` to a capture.

Hook sites are named by where they sit, ``blocks.{layer}.attn.{kind}``:

    q (B, H, L, d)   k, v (B, Hkv, L, d)   pattern (B, H, Lq, Lk)   z (B, H, L, d)
    head_out (B, H, L, E)   stats (a statistics object from headlab.attention_stats)

Gates act on z, not on the attention probabilities, so they work on every backend, fused ones
included (Hugging Face's old ``head_mask`` scaled probabilities and only worked on the eager path).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from headlab.attention import backends as _backends
from headlab.attention.core import attention_with_weights as _attention
from headlab.errors import ConfigError

SITE_KINDS = ("q", "k", "v", "pattern", "z", "head_out", "stats")


def site_name(layer: int, kind: str) -> str:
    """``site_name(3, "pattern") == "blocks.3.attn.pattern"``."""
    return f"blocks.{layer}.attn.{kind}"


@dataclass
class LayerState:
    """What headlab keeps on one attention module (as ``module._headlab``)."""

    layer: int  # index of the block this attention belongs to
    n_heads: int  # query heads, to split the output projection's input into heads
    head_dim: int
    backend: str | _backends.Backend | None = None  # set by use_backend; None = the module's own choice
    probe: Any = None  # an active capture (headlab.interpret.capture), or None
    adapter: Any = None  # the ModelAdapter (its gates and W_O); kept here so a deep copy stays consistent
    z_gated: torch.Tensor | None = None  # (B, H, L, d) stashed between W^O's pre-hook and hook


def _state(module: nn.Module) -> LayerState | None:
    return getattr(module, "_headlab", None)


def run_attention(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    scale: float | None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention for one layer of an adapted model, with capture. Returns ``(out (B, H, Lq, d), weights)``.

    Args:
        module: the attention module (carries the :class:`LayerState`).
        q: ``(B, H, Lq, d)``; k, v: ``(B, Hkv, Lk, d)``.
        mask: boolean, broadcastable to ``(B, H, Lq, Lk)``, True = may attend; or None.
        causal, scale, dropout_p: as in :func:`headlab.attention`.
        need_weights: also return the ``(B, H, Lq, Lk)`` weights (computed by the reference backend).

    The backend is the one chosen by :meth:`ModelAdapter.use_backend`, else the module's own
    ``backend`` attribute, else ``"auto"``. When a capture asks for this layer's pattern, the layer runs
    on the reference backend (the map is materialised anyway) so that the output is computed *from*
    the captured pattern and gradients with respect to it are real.
    """
    state = _state(module)
    probe = state.probe if state is not None else None
    backend = (state.backend if state is not None else None) or getattr(module, "backend", None) or "auto"
    if probe is not None:
        layer = state.layer
        if probe.grads:
            # make every captured site part of the graph even when the weights are frozen: these tensors
            # have no upstream graph to lose when they do not require grad
            q, k, v = (t if t.requires_grad else t.detach().requires_grad_(True) for t in (q, k, v))
        q = probe.record(layer, "q", q)  # (B, H, Lq, d)
        k = probe.record(layer, "k", k)  # (B, Hkv, Lk, d)
        v = probe.record(layer, "v", v)  # (B, Hkv, Lk, d)
        if probe.wants(layer, "stats"):
            probe.record_stats(layer, q, k, mask=mask, causal=causal, scale=scale)
        need_weights = need_weights or probe.wants(layer, "pattern")
    if need_weights:
        out, weights = _attention(q, k, v, mask=mask, causal=causal, scale=scale, dropout_p=dropout_p,
                                  backend="reference", need_weights=True)
        if probe is not None:
            weights = probe.record(layer, "pattern", weights)  # (B, H, Lq, Lk)
        return out, weights
    out, _ = _attention(q, k, v, mask=mask, causal=causal, scale=scale, dropout_p=dropout_p,
                        backend=backend, need_weights=False)
    return out, None


class ModelAdapter:
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

    def __init__(self, model: nn.Module, *, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 d_model: int, attn_modules: list[nn.Module], out_projs: list[nn.Module]) -> None:
        if not (len(attn_modules) == len(out_projs) == n_layers):
            raise ConfigError(f"adapter for {type(model).__name__}: found {len(attn_modules)} attention modules and "
                              f"{len(out_projs)} output projections for {n_layers} layers")
        self.model = model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.d_model = d_model
        self.attn_modules = list(attn_modules)
        self.out_projs = list(out_projs)
        p = next(model.parameters(), None)
        self._gates = torch.ones(n_layers, n_heads, device=p.device if p is not None else None)
        self._handles: list = []
        for i, (am, op) in enumerate(zip(self.attn_modules, self.out_projs)):
            # one state object, reachable from the attention module and from its output projection
            am._headlab = op._headlab = LayerState(layer=i, n_heads=n_heads, head_dim=head_dim, adapter=self)
            self._handles.append(op.register_forward_pre_hook(_gate_hook))
            self._handles.append(op.register_forward_hook(_head_out_hook))

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
            raise ConfigError(f"layer {layer!r} out of range: the model has {self.n_layers} layers (0..{self.n_layers - 1})")
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
            raise ConfigError(f"gates must have shape (n_layers, n_heads) = {(self.n_layers, self.n_heads)}, "
                              f"got {tuple(value.shape)}")
        if not value.is_floating_point():
            value = value.float()
        self._gates = value.to(self._gates.device)

    def reset_gates(self) -> None:
        """All gates back to 1 (a fresh tensor, not requiring grad)."""
        self._gates = torch.ones_like(self._gates, requires_grad=False)

    # -- backends ---------------------------------------------------------------------------------------
    @property
    def backend(self) -> str | _backends.Backend | None:
        """The backend set by the innermost :meth:`use_backend`, or None outside one."""
        return self.attn_modules[0]._headlab.backend if self.attn_modules else None

    @contextlib.contextmanager
    def use_backend(self, backend: str | _backends.Backend) -> Iterator[ModelAdapter]:
        """Inside the block every attention layer runs on ``backend`` (a registered name or a Backend).

            >>> import torch
            >>> from headlab.models import adapt
            >>> from headlab.models.transformer import Transformer, TransformerConfig
            >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
            >>> ids = torch.randint(0, 50, (1, 9))
            >>> with adapt(m).use_backend("reference"):
            ...     a = m(ids).logits
            >>> with adapt(m).use_backend("sdpa"):
            ...     b = m(ids).logits
            >>> torch.allclose(a, b, atol=1e-5)
            True
        """
        if not (isinstance(backend, str) and backend == "auto"):
            _backends.get(backend)  # UnknownBackendError naming the known ones
        saved = [am._headlab.backend for am in self.attn_modules]
        token = self._enter_backend()
        try:
            for am in self.attn_modules:
                am._headlab.backend = backend
            yield self
        finally:
            for am, b in zip(self.attn_modules, saved):
                am._headlab.backend = b
            self._exit_backend(token)

    def _enter_backend(self):
        """Route the model's attention through :func:`run_attention` (HF families switch the implementation)."""
        return None

    def _exit_backend(self, token) -> None:
        """Undo :meth:`_enter_backend`."""

    # -- capture support ----------------------------------------------------------------------------------
    def hook_sites(self) -> list[str]:
        """Every site a capture can ask for, layer by layer: ``blocks.{l}.attn.{q,k,v,pattern,z,head_out,stats}``."""
        return [site_name(i, kind) for i in range(self.n_layers) for kind in SITE_KINDS]

    @contextlib.contextmanager
    def _probing(self, probe) -> Iterator[None]:
        """Attach a capture probe to every layer for the duration of the block (always detached after)."""
        try:
            for am in self.attn_modules:
                am._headlab.probe = probe
            yield
        finally:
            for am in self.attn_modules:
                am._headlab.probe = None
                am._headlab.z_gated = None

    def forward(self, inputs):
        """Run the wrapped model on ``inputs`` (a dict of keyword tensors, or an input-id tensor)."""
        if isinstance(inputs, dict):
            return self.model(**inputs)
        return self.model(inputs)

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
        return (f"<{type(self).__name__} family={self.family!r} layers={self.n_layers} heads={self.n_heads} "
                f"kv_heads={self.n_kv_heads} head_dim={self.head_dim} d_model={self.d_model}>")


# -- the two hooks on every output projection W^O (module-level: they find everything on the module) ----------
def _gate_hook(module: nn.Module, args: tuple):
    """Pre-hook: split W^O's input into heads, report z, multiply by the gates, join again."""
    x = args[0]
    state: LayerState = module._headlab
    H, d = state.n_heads, state.head_dim
    lead = x.shape[:-1]
    z = x.reshape(*lead, H, d).movedim(-2, -3)  # (B, L, H*d) -> (B, H, L, d)
    probe = state.probe
    if probe is not None:
        z = probe.record(state.layer, "z", z)
    g = state.adapter.gates[state.layer].to(device=z.device, dtype=z.dtype).view(H, 1, 1)
    zg = z * g  # (B, H, L, d)
    state.z_gated = zg if probe is not None and probe.wants(state.layer, "head_out") else None
    return (zg.movedim(-3, -2).reshape(*lead, H * d), *args[1:])  # (B, L, H*d)


def _head_out_hook(module: nn.Module, args: tuple, output: torch.Tensor):
    """Hook: report head_out[h] = gated z_h @ W_O[h] (B, H, L, E); with grads, rebuild the output from it."""
    state: LayerState = module._headlab
    zg, state.z_gated = state.z_gated, None
    if zg is None or state.probe is None:
        return None
    adapter = state.adapter
    head_out = torch.einsum("bhld,hde->bhle", zg, adapter.W_O(state.layer).to(zg.dtype))  # (B, H, L, E)
    head_out = state.probe.record(state.layer, "head_out", head_out)
    if state.probe.grads:
        # route the output through head_out so that d scalar / d head_out is real
        b = adapter.b_O(state.layer)
        new = head_out.sum(-3)  # (B, L, E)
        return new if b is None else new + b
    return None
