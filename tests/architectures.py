"""Tiny random-weight models of 32 Hugging Face architectures, built from their configs (no downloads).

Every builder returns an eval-mode model in float32 on the eager attention path, with non-trivial
norm weights and biases (so that a norm layout read wrongly, or a bias left out, shows). Sizes are the
same everywhere: 2 layers, 4 query heads (2 kv heads where the family has grouped-query attention),
head size 8, vocabulary 97, at most 64 positions.

``ARCHITECTURES[model_type] = (builder, input kind)``; the input kinds are ``"text"`` (input_ids and
attention_mask), ``"image"`` (pixel_values) and ``"seq2seq"`` / ``"audio"`` for encoder-decoders.
"""

from __future__ import annotations

import torch
import transformers as T

V, E, LAYERS, H, KV, D, FF, POS = 97, 32, 2, 4, 2, 8, 64, 64


def _common(**kw):
    return dict(vocab_size=V, hidden_size=E, num_hidden_layers=LAYERS, num_attention_heads=H, intermediate_size=FF,
                max_position_embeddings=POS, attn_implementation="eager", **kw)


def _llama_like(cfg_cls, model_cls, **kw):
    return lambda: model_cls(cfg_cls(**_common(num_key_value_heads=KV, **kw)))


BUILDERS = {
    "bert": (lambda: T.BertModel(T.BertConfig(**_common())), "text"),
    "roberta": (lambda: T.RobertaModel(T.RobertaConfig(**_common(pad_token_id=1), )), "text"),
    "distilbert": (lambda: T.DistilBertModel(T.DistilBertConfig(
        vocab_size=V, dim=E, n_layers=LAYERS, n_heads=H, hidden_dim=FF, max_position_embeddings=POS,
        attn_implementation="eager")), "text"),
    "albert": (lambda: T.AlbertModel(T.AlbertConfig(**_common(embedding_size=16))), "text"),
    "electra": (lambda: T.ElectraModel(T.ElectraConfig(**_common(embedding_size=E))), "text"),
    "deberta-v2": (lambda: T.DebertaV2Model(T.DebertaV2Config(**_common(relative_attention=True,
                                                                          position_buckets=8))), "text"),
    "xlm-roberta": (lambda: T.XLMRobertaModel(T.XLMRobertaConfig(**_common(pad_token_id=1))), "text"),
    "modernbert": (lambda: T.ModernBertModel(T.ModernBertConfig(
        **_common(global_attn_every_n_layers=2, local_attention=4, pad_token_id=0))), "text"),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=E, n_layer=LAYERS, n_head=H, n_positions=POS,
                                                     attn_implementation="eager")), "text"),
    "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_common(rotary_pct=0.5))), "text"),
    "gptj": (lambda: T.GPTJForCausalLM(T.GPTJConfig(vocab_size=V, n_embd=E, n_layer=LAYERS, n_head=H, rotary_dim=4,
                                                    n_positions=POS, attn_implementation="eager")), "text"),
    "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(vocab_size=V, hidden_size=E, num_hidden_layers=LAYERS,
                                                 num_attention_heads=H, ffn_dim=FF, max_position_embeddings=POS,
                                                 word_embed_proj_dim=E, attn_implementation="eager")), "text"),
    "bloom": (lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=E, n_layer=LAYERS, n_head=H,
                                                       attn_implementation="eager")), "text"),
    "falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(
        vocab_size=V, hidden_size=E, num_hidden_layers=LAYERS, num_attention_heads=H, num_kv_heads=KV,
        new_decoder_architecture=True, max_position_embeddings=POS, attn_implementation="eager")), "text"),
    "llama": (_llama_like(T.LlamaConfig, T.LlamaForCausalLM), "text"),
    "mistral": (_llama_like(T.MistralConfig, T.MistralForCausalLM, sliding_window=5), "text"),
    "qwen2": (_llama_like(T.Qwen2Config, T.Qwen2ForCausalLM), "text"),
    "qwen3": (_llama_like(T.Qwen3Config, T.Qwen3ForCausalLM, head_dim=D), "text"),
    "gemma": (_llama_like(T.GemmaConfig, T.GemmaForCausalLM, head_dim=D), "text"),
    "gemma2": (_llama_like(T.Gemma2Config, T.Gemma2ForCausalLM, head_dim=D, sliding_window=4,
                           attn_logit_softcapping=2.0, final_logit_softcapping=None, query_pre_attn_scalar=16), "text"),
    "gemma3_text": (_llama_like(T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=D, sliding_window=4,
                                query_pre_attn_scalar=16, final_logit_softcapping=None), "text"),
    "phi": (lambda: T.PhiForCausalLM(T.PhiConfig(**_common(partial_rotary_factor=0.5))), "text"),
    "phi3": (_llama_like(T.Phi3Config, T.Phi3ForCausalLM, pad_token_id=0), "text"),
    "olmo": (_llama_like(T.OlmoConfig, T.OlmoForCausalLM, pad_token_id=0), "text"),
    "olmo2": (_llama_like(T.Olmo2Config, T.Olmo2ForCausalLM, pad_token_id=0), "text"),
    "stablelm": (_llama_like(T.StableLmConfig, T.StableLmForCausalLM, partial_rotary_factor=0.5,
                             use_qkv_bias=True), "text"),
    "starcoder2": (_llama_like(T.Starcoder2Config, T.Starcoder2ForCausalLM, sliding_window=5), "text"),
    "mixtral": (_llama_like(T.MixtralConfig, T.MixtralForCausalLM, num_local_experts=2, num_experts_per_tok=1), "text"),
    "cohere": (_llama_like(T.CohereConfig, T.CohereForCausalLM), "text"),
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=V, d_model=E, d_kv=D, d_ff=FF, num_layers=LAYERS, num_heads=H, relative_attention_num_buckets=8,
        decoder_start_token_id=0, attn_implementation="eager")), "seq2seq"),
    "bart": (lambda: T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=V, d_model=E, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=H,
        decoder_attention_heads=H, encoder_ffn_dim=FF, decoder_ffn_dim=FF, max_position_embeddings=POS,
        attn_implementation="eager")), "seq2seq"),
    "vit": (lambda: T.ViTModel(T.ViTConfig(hidden_size=E, num_hidden_layers=LAYERS, num_attention_heads=H,
                                           intermediate_size=FF, image_size=16, patch_size=4,
                                           attn_implementation="eager")), "image"),
    "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=V, d_model=E, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=H,
        decoder_attention_heads=H, encoder_ffn_dim=FF, decoder_ffn_dim=FF, num_mel_bins=8, max_source_positions=8,
        max_target_positions=POS, decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager")), "audio"),
}
NAMES = list(BUILDERS)


def build(name: str) -> torch.nn.Module:
    """The tiny model of architecture ``name``, with non-trivial norms and biases, in eval mode."""
    torch.manual_seed(0)
    model = BUILDERS[name][0]().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            low = n.lower()
            if n.endswith("bias") or "norm" in low or "ln" in low.split(".")[-2:-1][0:1] or low.endswith(
                    ("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def inputs(name: str, *, padded: bool = True, length: int = 11) -> dict:
    """A batch of two for architecture ``name``; the second row right-padded when ``padded``."""
    g = torch.Generator().manual_seed(1)
    kind = BUILDERS[name][1]
    if kind == "image":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    ids = torch.randint(2, V, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    if padded:
        mask[1, 7:] = 0  # right padding: every real query still sees a key
    if kind == "text":
        return {"input_ids": ids, "attention_mask": mask}
    dec = torch.randint(2, V, (2, 6), generator=g)
    if kind == "audio":
        return {"input_features": torch.randn(2, 8, 16, generator=g), "decoder_input_ids": dec}
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}
