"""How a block normalises around its attention: what residual-mode norms (Kobayashi et al. 2021) need.

Every adapter answers :meth:`~headlab.models.base.ModelAdapter.attention_norm` with a
:class:`BlockNorms`. The layouts met in practice, for the stream ``x`` entering the block:

============  ===============================================  =========================================
layout        what the block writes after its attention         families
============  ===============================================  =========================================
post          ``post(x + Attn(x))``                            BERT, RoBERTa, ELECTRA, DistilBERT, ALBERT
pre           ``x + Attn(pre(x))``                             GPT-2, Llama, Mistral, Qwen, OPT, ViT, ...
sandwich      ``x + post(Attn(pre(x)))`` (post on the branch)  Gemma 2, Gemma 3; OLMo 2 (no pre norm)
parallel      ``x + Attn(pre(x)) + MLP(pre'(x))``              GPT-J, GPT-NeoX, Phi, Falcon
============  ===============================================  =========================================

``kind`` is the post norm's kind (``layernorm`` centres, ``rmsnorm`` does not); ``offset`` is added to
its weight (Gemma's RMSNorm multiplies by ``1 + w``). A ``pre`` norm's parameters never matter to the
decomposition: the attention reads its output, the residual is its input.

A **scaled residual branch** multiplies the attention's output (W^O's, bias included) before the block reads
it: by a number (Granite's ``residual_multiplier``: ``x + m * Attn(x)``) or channel by channel by a learned
vector (LayerScale: DINOv2, BEiT, CaiT: ``x + lambda * Attn(x)``). ``branch_scale`` holds it, and every layout
above reads ``branch(Attn(x))`` where it reads ``Attn(x)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn


@dataclass(frozen=True)
class BlockNorms:
    """The normalisation around one attention layer (see the module docstring).

    Attributes:
        pre: the norm that makes the attention's input (None: the attention reads the stream).
        post: the norm after the attention (None: none).
        post_reads: ``"sum"`` (the post norm reads ``x + Attn(x)``, BERT) or ``"branch"`` (it reads
            ``Attn(x)`` alone and the block adds the stream after it, Gemma 2).
        kind: ``"layernorm"`` or ``"rmsnorm"``, of the post norm.
        offset: added to the post norm's weight (1.0 for Gemma's ``1 + w``).
        parallel: a module whose output the block adds beside the attention's, reading the same
            stream (the MLP of GPT-J, GPT-NeoX, Phi, Falcon); None for sequential blocks.
        branch_scale: what the attention's output is multiplied by before the block reads it (a number, or a
            ``(E,)`` LayerScale vector, the model's own parameter); None: not scaled.
    """

    pre: nn.Module | None = None
    post: nn.Module | None = None
    post_reads: Literal["sum", "branch"] = "sum"
    kind: Literal["layernorm", "rmsnorm"] = "layernorm"
    offset: float = 0.0
    parallel: nn.Module | None = None
    branch_scale: torch.Tensor | float | None = field(default=None, compare=False)

    def branch(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (vectors of the residual width on the last axis) scaled as the block scales its attention
        branch; ``t`` itself when the branch is not scaled."""
        s = self.branch_scale
        if s is None:
            return t
        return t * (s.detach().to(device=t.device, dtype=t.dtype) if isinstance(s, torch.Tensor) else float(s))

    @property
    def layout(self) -> str:
        """``"post"``, ``"sandwich"``, ``"parallel"`` or ``"pre"``."""
        if self.post is not None:
            return "post" if self.post_reads == "sum" else "sandwich"
        return "parallel" if self.parallel is not None else "pre"

    @property
    def norm(self) -> nn.Module | None:
        """The norm whose linear part the decomposition applies (the post norm), else the pre norm."""
        return self.post if self.post is not None else self.pre

    def scale(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The post norm's elementwise scale (``offset + weight``), or None when it has none."""
        w = getattr(self.post, "weight", None)
        if w is None:
            return None
        return w.detach().to(dtype) + self.offset

    def eps(self) -> float:
        """The post norm's epsilon (``eps`` or ``variance_epsilon``; 1e-5 when it keeps none)."""
        for name in ("eps", "variance_epsilon"):
            if hasattr(self.post, name):
                return float(getattr(self.post, name))
        return 1e-5


__all__ = ["BlockNorms"]
