"""Four tiny decoders written the way remote code (``trust_remote_code``) and research code are written: each
attention module computes attention with its own math, never calling transformers' attention interface.

- ``packed_grouped`` (InternLM2-style): one ``wqkv`` projection packed per key/value group (``r`` query heads, then
  the group's key, then its value), rotary positions applied inside the module, ``repeat_kv``, then
  ``softmax(q k^T / sqrt(d) + mask) v`` and ``wo``;
- ``w_pack`` (Baichuan-style): one ``W_pack`` projection ``[Q|K|V]`` and a softmax written by hand
  (``exp(s - max) / sum``), ``o_proj``;
- ``nanogpt``: a ``c_attn`` projection ``[Q|K|V]``, a causal mask buffer applied with ``masked_fill(-inf)``,
  ``F.softmax``, ``c_proj`` (Karpathy's nanoGPT ``CausalSelfAttention``);
- ``sdpa_direct``: separate projections and a direct ``F.scaled_dot_product_attention(..., is_causal=True)`` call.

Each is a ``PreTrainedModel`` with its own config class registered under its own ``model_type``, so that
``save_pretrained`` and ``headlab.load`` work on it as on remote code that was trusted. Sizes as in
``architectures``: 2 layers, 4 query heads (2 kv heads for the grouped one), head size 8.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

V, E, LAYERS, H, KV, D = 97, 32, 2, 4, 2, 8


class OwnConfig(PretrainedConfig):
    model_type = "own_math_test"

    def __init__(self, style="nanogpt", vocab_size=V, hidden_size=E, num_hidden_layers=LAYERS,
                 num_attention_heads=H, num_key_value_heads=H, max_position_embeddings=64, **kw):
        self.style = style
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kw)


def _rotary(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary positions (Su et al. 2021) on ``x (B, heads, L, d)``, halves rotated."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class PackedGroupedAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.wqkv = nn.Linear(E, (self.num_heads + 2 * self.num_key_value_heads) * D, bias=False)
        self.wo = nn.Linear(self.num_heads * D, E, bias=False)

    def forward(self, x, mask):
        B, L, _ = x.shape
        r = self.num_key_value_groups
        qkv = self.wqkv(x).view(B, L, self.num_key_value_heads, r + 2, self.head_dim)
        q = qkv[..., :r, :].reshape(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = qkv[..., -2, :].transpose(1, 2)
        v = qkv[..., -1, :].transpose(1, 2)
        pos = torch.arange(L)
        q, k = _rotary(q, pos), _rotary(k, pos)
        k = k[:, :, None].expand(B, self.num_key_value_heads, r, L, D).reshape(B, self.num_heads, L, D)
        v = v[:, :, None].expand(B, self.num_key_value_heads, r, L, D).reshape(B, self.num_heads, L, D)
        s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        s = s + mask
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(p, v).transpose(1, 2).reshape(B, L, -1)
        return self.wo(out), p


class WPackAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, D
        self.hidden_size = self.num_heads * self.head_dim
        self.W_pack = nn.Linear(E, 3 * self.hidden_size, bias=True)
        self.o_proj = nn.Linear(self.hidden_size, E, bias=False)

    def forward(self, x, mask):
        B, L, _ = x.shape
        q, k, v = self.W_pack(x).unflatten(-1, (3, self.hidden_size)).unbind(-2)
        q, k, v = (t.view(B, L, self.num_heads, D).transpose(1, 2) for t in (q, k, v))
        s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(D)
        s = s + mask
        e = torch.exp(s - s.amax(dim=-1, keepdim=True))  # its own softmax
        p = e / e.sum(dim=-1, keepdim=True)
        return self.o_proj(torch.matmul(p, v).transpose(1, 2).reshape(B, L, self.hidden_size)), p


class NanoGPTAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.num_attention_heads
        self.c_attn = nn.Linear(E, 3 * E)
        self.c_proj = nn.Linear(E, E)
        n = cfg.max_position_embeddings
        self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n), persistent=False)

    def forward(self, x, mask):
        B, L, C = x.size()
        q, k, v = self.c_attn(x).split(E, dim=2)
        k = k.view(B, L, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, L, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, L, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :L, :L] == 0, float("-inf"))
        att = att + mask  # padding (0 or the dtype's minimum)
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, L, C)), att


class SdpaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(E, E) for _ in range(3))
        self.o_proj = nn.Linear(E, E)

    def forward(self, x, mask):
        B, L, _ = x.shape
        q, k, v = (p(x).view(B, L, self.num_heads, D).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        keep = mask > torch.finfo(mask.dtype).min / 2  # (B, 1, L, L), causal and padding
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, E)), None  # SDPA gives no weights


ATTENTION = {"packed_grouped": PackedGroupedAttention, "w_pack": WPackAttention, "nanogpt": NanoGPTAttention,
             "sdpa_direct": SdpaAttention}


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.attn = ATTENTION[cfg.style](cfg)
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))

    def forward(self, x, mask):
        a, p = self.attn(self.ln_1(x), mask)
        x = x + a
        return x + self.mlp(self.ln_2(x)), p


class OwnBody(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, E)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.ln_f = nn.LayerNorm(E)


class OwnForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = OwnConfig
    base_model_prefix = "transformer"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.transformer = OwnBody(cfg)
        self.lm_head = nn.Linear(E, cfg.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_attentions=False, **kw):
        x = self.transformer.wte(input_ids) if inputs_embeds is None else inputs_embeds
        B, L = x.shape[:2]
        keep = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
        if attention_mask is not None:
            keep = keep & attention_mask.bool()[:, None, None, :]
        mask = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, torch.finfo(x.dtype).min)
        maps = []
        for block in self.transformer.h:
            x, p = block(x, mask)
            maps.append(p)
        weights = tuple(maps) if output_attentions and all(p is not None for p in maps) else None
        return CausalLMOutput(logits=self.lm_head(self.transformer.ln_f(x)), attentions=weights)


AutoConfig.register(OwnConfig.model_type, OwnConfig, exist_ok=True)
AutoModelForCausalLM.register(OwnConfig, OwnForCausalLM, exist_ok=True)
AutoModel.register(OwnConfig, OwnForCausalLM, exist_ok=True)


def build(style: str) -> OwnForCausalLM:
    """The tiny model of ``style`` (see the module docstring), non-trivial norms and biases, in eval mode."""
    torch.manual_seed(0)
    model = OwnForCausalLM(OwnConfig(style=style, num_key_value_heads=KV if style == "packed_grouped" else H)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "ln" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


def inputs(padded: bool = True, length: int = 11) -> dict:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, length, dtype=torch.long)
    if padded:
        mask[1, 7:] = 0
    return {"input_ids": torch.randint(2, V, (2, length), generator=g), "attention_mask": mask}


STYLES = list(ATTENTION)
