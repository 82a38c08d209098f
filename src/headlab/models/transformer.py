"""headlab's own small transformer: encoder or decoder, built on :class:`headlab.MultiHeadAttention`.

Pre-norm blocks (GPT-2's layout)::

    x = tok_emb[ids] + pos_emb[positions]                         (B, L, E)
    for each block:  x = x + Attn(LN1(x));  x = x + MLP(LN2(x))
    logits = LN_f(x) @ tok_emb^T                                  (B, L, vocab)   (tied embeddings)

Trainable like any ``nn.Module``; saved as a folder holding ``headlab_config.json`` (the
:class:`TransformerConfig`) and ``model.safetensors`` (the weights), which ``headlab.load(PATH)`` opens.

    >>> import torch, tempfile
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, causal=True)
    >>> m = Transformer(cfg).eval()
    >>> ids = torch.randint(0, 64, (2, 10))
    >>> m(ids).logits.shape
    torch.Size([2, 10, 64])
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = m.save(d)
    ...     m2 = Transformer.load(d)
    >>> torch.equal(m(ids).logits, m2(ids).logits)
    True
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import cast

import torch
from torch import nn

from headlab.attention.module import MultiHeadAttention
from headlab.errors import ConfigError, ModelError, ShapeError
from headlab.models.base import ModelAdapter
from headlab.models.norm_layout import BlockNorms
from headlab.models.projections import Out, Separate
from headlab.models.sites import run_attention, state_of

CONFIG_FILE = "headlab_config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes and options of :class:`Transformer`; each field says why it exists."""

    vocab_size: int = 256  # token ids 0..vocab_size-1 (256: bytes, no tokenizer needed)
    d_model: int = 64  # residual width E
    n_layers: int = 2  # blocks
    n_heads: int = 4  # query heads H; head_dim = d_model // n_heads
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); None = n_heads
    d_ff: int = 256  # MLP hidden width
    max_positions: int = 128  # learned position embeddings: the longest input
    causal: bool = False  # False: an encoder (every token sees every token); True: a decoder
    dropout: float = 0.0  # on attention probabilities and residual branches while training
    bias: bool = True  # biases on the attention projections

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"TransformerConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            raise ConfigError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={kv}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TransformerConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown TransformerConfig fields {unknown}; known: {sorted(known)}")
        return cls(**d)


class Attention(MultiHeadAttention):
    """:class:`~headlab.MultiHeadAttention` whose attention call goes through the adapter's
    :func:`~headlab.models.sites.run_attention` (so backends, capture and gates work as for HF models).

    One gate per head: once the model is adapted, ``head_gate`` is a view of the adapter's
    ``gates[layer]`` and the adapter's W^O pre-hook applies it; before that, this module applies it.
    """

    def forward(  # type: ignore[override]  # self-attention on x only: the block's call, not MultiHeadAttention's (q, k, v)
        self,
        x: torch.Tensor,
        *,
        key_mask: torch.Tensor | None = None,
        causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention on ``x (B, L, E)``; ``key_mask (B, L)`` bool, True = a real token."""
        B, L, _ = x.shape
        H, Hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, L, H, d).transpose(1, 2)  # (B, H, L, d)
        k = self.k_proj(x).view(B, L, Hkv, d).transpose(1, 2)  # (B, Hkv, L, d)
        v = self.v_proj(x).view(B, L, Hkv, d).transpose(1, 2)  # (B, Hkv, L, d)
        mask = None if key_mask is None else key_mask.view(B, 1, 1, L)  # (B, 1, 1, L)
        z, w = run_attention(
            self,
            q,
            k,
            v,
            mask,
            causal=causal,
            scale=None,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
        )
        if state_of(self.out_proj) is None:  # not adapted: the module's own gate (the adapter's hook does it otherwise)
            z = z * self.head_gate.view(1, H, 1, 1).to(z.dtype)  # (B, H, L, d)
        return self.out_proj(z.transpose(1, 2).reshape(B, L, H * d)), w  # (B, L, E)


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_heads, num_kv_heads=cfg.kv_heads, bias=cfg.bias, dropout=cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)
        self.causal = cfg.causal

    def forward(self, x, key_mask, need_weights):
        a, w = self.attn(self.ln1(x), key_mask=key_mask, causal=self.causal, need_weights=need_weights)
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.ln2(x))), w


@dataclass
class TransformerOutput:
    logits: torch.Tensor  # (B, L, vocab)
    last_hidden_state: torch.Tensor  # (B, L, E), after the final norm
    attentions: tuple[torch.Tensor, ...] | None = None  # per layer (B, H, L, L) when asked for


class Transformer(nn.Module):
    """A small encoder (``causal=False``) or decoder (``causal=True``); see the module docstring."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise ConfigError(f"Transformer expects a TransformerConfig, got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_positions, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, output_attentions: bool = False
    ) -> TransformerOutput:
        """``input_ids (B, L)`` ints; ``attention_mask (B, L)`` 1/True = a real token, 0 = padding."""
        if input_ids.dim() != 2:
            raise ShapeError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        B, L = input_ids.shape
        if L > self.config.max_positions:
            raise ShapeError(f"input has {L} positions; this model reads at most {self.config.max_positions}")
        key_mask = None if attention_mask is None else attention_mask.bool()
        pos = torch.arange(L, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))  # (B, L, E)
        maps = []
        for block in self.blocks:
            x, w = block(x, key_mask, output_attentions)
            maps.append(w)
        h = self.ln_f(x)
        logits = h @ self.tok_emb.weight.t()  # (B, L, vocab)
        return TransformerOutput(logits, h, tuple(maps) if output_attentions else None)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (Hugging Face's name for it), so headlab's checks and instruments find it the one way."""
        return self.tok_emb

    # -- save / load ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write ``headlab_config.json`` and ``model.safetensors`` into the folder ``path`` (created)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(
            json.dumps({"model_type": "headlab-transformer", **self.config.to_dict()}, indent=2) + "\n"
        )
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_FILE))
        return path

    @classmethod
    def load(cls, path: str | Path, *, device: str | torch.device = "cpu") -> Transformer:
        """Read a folder written by :meth:`save`."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise ModelError(f"{path} is not a saved headlab Transformer (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
        raw = json.loads((path / CONFIG_FILE).read_text())
        raw.pop("model_type", None)
        model = cls(TransformerConfig.from_dict(raw))
        missing, unexpected = model.load_state_dict(load_file(str(path / WEIGHTS_FILE)), strict=False)
        if missing or unexpected:
            raise ModelError(
                f"{path / WEIGHTS_FILE} does not match its config: missing {missing}, unexpected {unexpected}"
            )
        return model.to(device).eval()


class TransformerAdapter(ModelAdapter):
    """The adapter of headlab's own :class:`Transformer` (nn.Linear projections, as in MultiHeadAttention)."""

    family = "headlab"
    own_model = True
    model: Transformer

    def __init__(self, model: Transformer) -> None:
        cfg = model.config
        blocks = cast("list[Block]", list(model.blocks))
        super().__init__(
            model,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            d_model=cfg.d_model,
            attn_modules=[b.attn for b in blocks],
            out_projs=[b.attn.out_proj for b in blocks],
        )
        self._gates = torch.stack([b.attn.head_gate.detach() for b in blocks]).float()
        self._share_gates()

    @property
    def causal(self) -> bool:
        return self.model.config.causal

    def _share_gates(self) -> None:
        """Make every block's ``attn.head_gate`` a view of ``gates[layer]``: one gate per head."""
        for i, am in enumerate(self.attn_modules):
            am.head_gate = self._gates[i]

    @ModelAdapter.gates.setter  # type: ignore[attr-defined]  # mypy cannot follow a setter added to the parent's property
    def gates(self, value: torch.Tensor) -> None:
        ModelAdapter.gates.fset(self, value)  # type: ignore[attr-defined]  # as above
        self._share_gates()

    def reset_gates(self) -> None:
        super().reset_gates()
        self._share_gates()

    def attention_norm(self, layer):
        return BlockNorms(pre=self.model.blocks[self._check_layer(layer)].ln1, kind="layernorm")

    def _weights(self, layer, which):
        return getattr(self.attn_modules[layer], f"W_{which.upper()}")

    def _bias(self, layer, which):
        am = self.attn_modules[layer]
        lin = {"q": am.q_proj, "k": am.k_proj, "v": am.v_proj, "o": am.out_proj}[which]
        if lin.bias is None or which == "o":
            return lin.bias
        heads = self.layer_heads[layer] if which == "q" else self.layer_kv_heads[layer]
        return lin.bias.view(heads, self.head_dim)

    def cut_heads(self, attn, out, q_heads, kv_heads, H, Hkv):
        Separate().cut(attn, q_heads, kv_heads, H, Hkv, self.head_dim)
        Out("attn.out_proj").cut(out, q_heads, self.head_dim)
        attn.head_gate = attn.head_gate[list(q_heads)].clone()
        attn.num_heads, attn.num_kv_heads = len(q_heads), len(kv_heads)
