"""Tiny random-weight models of 75 Hugging Face architectures, built from their configs (no downloads).

Every builder returns an eval-mode model in float32 on the eager attention path, with non-trivial
norm weights and biases (so that a norm layout read wrongly, or a bias left out, shows). Sizes are the
same everywhere: 2 layers, 4 query heads (2 kv heads where the family has grouped-query attention),
head size 8, vocabulary 97, at most 64 positions.

``BUILDERS[model_type] = (builder, input kind)``; the input kinds are ``"text"`` (input_ids and
attention_mask), ``"image"`` (pixel_values), ``"wave"`` (input_values: a waveform under a convolutional front
end) and ``"seq2seq"`` / ``"audio"`` for encoder-decoders. The first 32 are the types a headlab family
declares; :data:`STRUCTURE` are types no family names, which headlab adapts by structure and checks at load;
:data:`REFUSED_BY_STRUCTURE` are types whose structure headlab cannot serve, each refused with the reason.
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
    "eurobert": (_llama_like(T.EuroBertConfig, T.EuroBertModel, head_dim=D, pad_token_id=0, bos_token_id=1,
                             eos_token_id=1, mask_token_id=2), "text"),
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


def _auto(model_type: str, **kw):
    """A tiny model of ``model_type`` from ``AutoConfig.for_model`` with the common size fields set (each only
    where the config has it) and ``kw`` on top."""
    sizes = dict(hidden_size=E, d_model=E, n_embd=E, num_hidden_layers=LAYERS, n_layer=LAYERS, num_layers=LAYERS,
                 encoder_layers=LAYERS, decoder_layers=LAYERS, num_attention_heads=H, n_head=H, num_heads=H,
                 encoder_attention_heads=H, decoder_attention_heads=H, num_key_value_heads=KV, intermediate_size=FF,
                 encoder_ffn_dim=FF, decoder_ffn_dim=FF, ffn_dim=FF, vocab_size=V, max_position_embeddings=POS,
                 image_size=16, patch_size=4, head_dim=D, moe_intermediate_size=16, num_experts=2,
                 num_local_experts=2, num_experts_per_tok=1)

    def build():
        cfg = T.AutoConfig.for_model(model_type)
        for k, v in {**sizes, **kw}.items():
            if hasattr(cfg, k) or k in kw:
                setattr(cfg, k, v)
        if getattr(cfg, "layer_types", None):  # one entry per layer
            cfg.layer_types = list(cfg.layer_types)[:LAYERS]
        return T.AutoModel.from_config(cfg, attn_implementation="eager")
    return build


def _s2s(cfg_cls, model_cls, **kw):
    base = dict(vocab_size=V, d_model=E, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=H,
                decoder_attention_heads=H, encoder_ffn_dim=FF, decoder_ffn_dim=FF, max_position_embeddings=POS,
                attn_implementation="eager", pad_token_id=1, decoder_start_token_id=2)
    return lambda: model_cls(cfg_cls(**{**base, **kw}))


_VIS = dict(hidden_size=E, num_hidden_layers=LAYERS, num_attention_heads=H, intermediate_size=FF, image_size=16,
            patch_size=4, attn_implementation="eager")
_WAVE = dict(hidden_size=E, num_hidden_layers=LAYERS, num_attention_heads=H, intermediate_size=FF, conv_dim=(8, 8),
             conv_stride=(4, 4), conv_kernel=(8, 4), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
             attn_implementation="eager")

# types no headlab family declares: adapted by structure, verified at load
STRUCTURE_BUILDERS = {
    # decoders, MoE decoders
    "qwen2_moe": (_llama_like(T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, num_experts=2, num_experts_per_tok=1,
                              moe_intermediate_size=16, shared_expert_intermediate_size=16), "text"),
    "qwen3_moe": (_llama_like(T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, head_dim=D, num_experts=2, num_experts_per_tok=1,
                              moe_intermediate_size=16), "text"),
    "smollm3": (_llama_like(T.SmolLM3Config, T.SmolLM3ForCausalLM, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                "text"),
    "granite": (_llama_like(T.GraniteConfig, T.GraniteForCausalLM), "text"),
    "granitemoe": (_llama_like(T.GraniteMoeConfig, T.GraniteMoeForCausalLM, num_local_experts=2, num_experts_per_tok=1),
                   "text"),
    "olmoe": (_llama_like(T.OlmoeConfig, T.OlmoeForCausalLM, num_experts=2, num_experts_per_tok=1, pad_token_id=0,
                          eos_token_id=2), "text"),
    "glm4": (_llama_like(T.Glm4Config, T.Glm4ForCausalLM, head_dim=D, pad_token_id=0), "text"),
    "nemotron": (_llama_like(T.NemotronConfig, T.NemotronForCausalLM, head_dim=D, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2), "text"),
    "gpt_bigcode": (lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
        vocab_size=V, n_embd=E, n_layer=LAYERS, n_head=H, n_positions=POS, multi_query=True, bos_token_id=1,
        eos_token_id=2, attn_implementation="eager")), "text"),
    "cohere2": (_llama_like(T.Cohere2Config, T.Cohere2ForCausalLM, sliding_window=4, eos_token_id=2,
                            layer_types=["sliding_attention", "full_attention"]), "text"),
    "olmo3": (_auto("olmo3", pad_token_id=0, eos_token_id=2, bos_token_id=1), "text"),
    "arcee": (_auto("arcee", pad_token_id=0, eos_token_id=2, bos_token_id=1), "text"),
    "helium": (_auto("helium", pad_token_id=0, eos_token_id=2, bos_token_id=1), "text"),
    "ernie4_5": (_auto("ernie4_5", pad_token_id=0, eos_token_id=2, bos_token_id=1), "text"),
    "seed_oss": (_auto("seed_oss", pad_token_id=0, eos_token_id=2, bos_token_id=1), "text"),
    "hunyuan_v1_dense": (_auto("hunyuan_v1_dense", pad_token_id=0, eos_token_id=2, bos_token_id=1), "text"),
    "apertus": (_auto("apertus", pad_token_id=0, eos_token_id=2, bos_token_id=1), "text"),
    "ministral": (_auto("ministral", pad_token_id=0, eos_token_id=2, bos_token_id=1), "text"),
    "exaone4": (_auto("exaone4", pad_token_id=0, eos_token_id=2, bos_token_id=1), "text"),
    "biogpt": (_auto("biogpt", pad_token_id=1, eos_token_id=2, bos_token_id=0), "text"),
    # encoders
    "camembert": (lambda: T.CamembertModel(T.CamembertConfig(**_common(pad_token_id=1))), "text"),
    "esm": (lambda: T.EsmModel(T.EsmConfig(**_common(pad_token_id=1, mask_token_id=2,
                                                      position_embedding_type="rotary"))), "text"),
    "ernie": (_auto("ernie", pad_token_id=0), "text"),
    "data2vec-text": (_auto("data2vec-text", pad_token_id=1), "text"),
    "xlm-roberta-xl": (_auto("xlm-roberta-xl", pad_token_id=1), "text"),
    # vision
    "deit": (lambda: T.DeiTModel(T.DeiTConfig(**_VIS)), "image"),
    "beit": (lambda: T.BeitModel(T.BeitConfig(**_VIS, use_relative_position_bias=True)), "image"),
    "dinov2": (lambda: T.Dinov2Model(T.Dinov2Config(**{k: v for k, v in _VIS.items() if k != "intermediate_size"},
                                                    mlp_ratio=2)), "image"),
    "siglip_vision_model": (lambda: T.SiglipVisionModel(T.SiglipVisionConfig(**_VIS)), "image"),
    "clip_vision_model": (lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**_VIS)), "image"),
    "vit_msn": (lambda: T.ViTMSNModel(T.ViTMSNConfig(**_VIS)), "image"),
    # audio encoders (a convolutional front end, then a transformer encoder)
    "wav2vec2": (lambda: T.Wav2Vec2Model(T.Wav2Vec2Config(**_WAVE)), "wave"),
    "hubert": (lambda: T.HubertModel(T.HubertConfig(**_WAVE)), "wave"),
    "unispeech": (lambda: T.UniSpeechModel(T.UniSpeechConfig(**_WAVE)), "wave"),
    "sew": (lambda: T.SEWModel(T.SEWConfig(**_WAVE, squeeze_factor=1)), "wave"),
    # encoder-decoders
    "mbart": (_s2s(T.MBartConfig, T.MBartForConditionalGeneration), "seq2seq"),
    "pegasus": (_s2s(T.PegasusConfig, T.PegasusForConditionalGeneration), "seq2seq"),
    "marian": (_s2s(T.MarianConfig, T.MarianMTModel, decoder_vocab_size=V), "seq2seq"),
    "m2m_100": (_s2s(T.M2M100Config, T.M2M100ForConditionalGeneration), "seq2seq"),
    "blenderbot": (_s2s(T.BlenderbotConfig, T.BlenderbotForConditionalGeneration), "seq2seq"),
    "blenderbot-small": (_s2s(T.BlenderbotSmallConfig, T.BlenderbotSmallForConditionalGeneration), "seq2seq"),
    "plbart": (_s2s(T.PLBartConfig, T.PLBartForConditionalGeneration), "seq2seq"),
    "mt5": (lambda: T.MT5ForConditionalGeneration(T.MT5Config(
        vocab_size=V, d_model=E, d_kv=D, d_ff=FF, num_layers=LAYERS, num_heads=H, relative_attention_num_buckets=8,
        decoder_start_token_id=0, attn_implementation="eager")), "seq2seq"),
}

# --- hybrid stacks (helper "hybrids"): blocks without attention (SSM, convolution, linear-recurrent, MLP-only)
# between the attention blocks. 4 blocks, of which 2 attend (the model's blocks 1 and 3: headlab's layers 0 and 1,
# named blocks.1.attn and blocks.3.attn), the usual sizes otherwise. Falcon-H1 runs a Mamba mixer beside the
# attention in every block; Nemotron-H attends in blocks 0 and 2 and its blocks between are MLP-only (nothing mixes
# tokens outside attention: rollout is served).
_HYB = dict(vocab_size=V, hidden_size=E, num_attention_heads=H, num_key_value_heads=KV, head_dim=D,
            intermediate_size=FF, max_position_embeddings=POS, pad_token_id=0, eos_token_id=2, bos_token_id=1,
            num_hidden_layers=4)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=4, mamba_n_groups=1, mamba_chunk_size=8)


def _hybrid(cfg_cls, model_cls, **kw):
    return lambda: model_cls(cfg_cls(**{**_HYB, **kw}, attn_implementation="eager"))


HYBRID_BUILDERS = {
    "jamba": (_hybrid(T.JambaConfig, T.JambaForCausalLM, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4,
                      mamba_expand=2, mamba_dt_rank=4, expert_layer_period=100, num_experts=1), "text"),
    "bamba": (_hybrid(T.BambaConfig, T.BambaForCausalLM, attn_layer_indices=[1, 3], **_MAMBA2), "text"),
    "lfm2": (_hybrid(T.Lfm2Config, T.Lfm2ForCausalLM, layer_types=["conv", "full_attention"] * 2), "text"),
    "olmo_hybrid": (_hybrid(T.OlmoHybridConfig, T.OlmoHybridForCausalLM,
                            layer_types=["linear_attention", "full_attention"] * 2), "text"),
    "granitemoehybrid": (_hybrid(T.GraniteMoeHybridConfig, T.GraniteMoeHybridForCausalLM, num_local_experts=2,
                                 num_experts_per_tok=1, layer_types=["mamba", "attention"] * 2, **_MAMBA2), "text"),
    "nemotron_h": (_hybrid(T.NemotronHConfig, T.NemotronHForCausalLM, layers_block_type=["attention", "mlp"] * 2,
                           mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=4, n_groups=1, chunk_size=8), "text"),
    "falcon_h1": (_hybrid(T.FalconH1Config, T.FalconH1ForCausalLM, **{**_MAMBA2, "num_hidden_layers": LAYERS},
                          mamba_d_ssm=64), "text"),
}
STRUCTURE_BUILDERS.update(HYBRID_BUILDERS)
# --- end of hybrid stacks

# types whose structure headlab cannot serve: each refused at load and adapt, with what structure showed
REFUSED_BY_STRUCTURE = {
    "gpt_oss": (_llama_like(T.GptOssConfig, T.GptOssForCausalLM, head_dim=D, num_local_experts=2, num_experts_per_tok=1,
                            sliding_window=4, layer_types=["sliding_attention", "full_attention"]), "s_aux"),
    "swin": (lambda: T.SwinModel(T.SwinConfig(image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                                              window_size=2, attn_implementation="eager")), "differ in heads"),
    "codegen": (lambda: T.CodeGenForCausalLM(T.CodeGenConfig(vocab_size=V, n_embd=E, n_layer=LAYERS, n_head=H,
                                                             rotary_dim=4, n_positions=POS, n_ctx=POS,
                                                             attn_implementation="eager")), "computes the values"),
    "mobilebert": (lambda: T.MobileBertModel(T.MobileBertConfig(**_common(embedding_size=16, intra_bottleneck_size=16,
                                                                          true_hidden_size=16))), "query projection"),
    "deepseek_v3": (_llama_like(T.DeepseekV3Config, T.DeepseekV3ForCausalLM, q_lora_rank=16, kv_lora_rank=16,
                                qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=2,
                                num_experts_per_tok=1, moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
                                topk_group=1), "latent"),
}

# --- own-module attention (issue 40): types whose attention modules compute attention with their own math (no call
# of transformers' attention interface), served through headlab's bridge (headlab.models.hf.own_bridge), then
# further types of the groups (decoders, encoders, vision, audio, encoder-decoders) that structure serves.
# Each is adapted by structure and checked at load; those it cannot serve are in OWN_REFUSED, with the words of
# the refusal (the check that failed, or the op headlab cannot follow).
OWN_BUILDERS = {
    # attention in the model's own modules
    "gpt_neo": (lambda: T.GPTNeoModel(T.GPTNeoConfig(
        vocab_size=V, hidden_size=E, num_layers=LAYERS, num_heads=H, intermediate_size=FF, max_position_embeddings=POS,
        attention_types=[[["global", "local"], 1]], window_size=4, attn_implementation="eager")), "text"),
    "big_bird": (_auto("big_bird", attention_type="original_full", pad_token_id=0), "text"),
    "roformer": (lambda: T.RoFormerModel(T.RoFormerConfig(**_common(embedding_size=E))), "text"),
    "mpt": (lambda: T.MptForCausalLM(T.MptConfig(vocab_size=V, d_model=E, n_layers=LAYERS, n_heads=H, max_seq_len=POS,
                                                 attn_implementation="eager")), "text"),
    "mpnet": (_auto("mpnet", pad_token_id=1), "text"),
    "rembert": (_auto("rembert", input_embedding_size=16, output_embedding_size=16, pad_token_id=0), "text"),
    "luke": (_auto("luke", entity_vocab_size=8, entity_emb_size=16, pad_token_id=1), "text"),
    "tapas": (_auto("tapas", pad_token_id=0), "text"),
    "imagegpt": (_auto("imagegpt", n_positions=POS), "text"),
    "visual_bert": (_auto("visual_bert", visual_embedding_dim=16, pad_token_id=1), "text"),
    "megatron-bert": (_auto("megatron-bert", pad_token_id=0), "text"),
    "mvp": (_s2s(T.MvpConfig, T.MvpForConditionalGeneration), "seq2seq"),
    "xglm": (_auto("xglm", pad_token_id=1), "text"),
    # DeBERTa-v2's disentangled attention: content-to-position and position-to-content terms (an additive bias
    # computed from q and k), no longer refused by name
    "deberta-v2": (lambda: T.DebertaV2Model(T.DebertaV2Config(**_common(relative_attention=True, position_buckets=8,
                                                                          pos_att_type=["p2c", "c2p"]))), "text"),
    # decoders and encoders that call the interface, not swept before
    "ctrl": (_auto("ctrl", n_positions=POS), "text"),
    "persimmon": (_auto("persimmon", pad_token_id=0, eos_token_id=2, bos_token_id=1), "text"),
    "phimoe": (_auto("phimoe", pad_token_id=0, eos_token_id=2, bos_token_id=1), "text"),
    "roc_bert": (_auto("roc_bert", pronunciation_vocab_size=16, shape_vocab_size=16, pronunciation_embed_dim=8,
                       shape_embed_dim=8, pad_token_id=0), "text"),
    "roberta-prelayernorm": (_auto("roberta-prelayernorm", pad_token_id=1), "text"),
    "bert-generation": (_auto("bert-generation", pad_token_id=0, bos_token_id=1, eos_token_id=2), "text"),
    "layoutlm": (_auto("layoutlm", pad_token_id=0), "text"),
    "markuplm": (_auto("markuplm", pad_token_id=1), "text"),
    # vision
    "data2vec-vision": (_auto("data2vec-vision"), "image"),
    "ijepa": (_auto("ijepa"), "image"),
    "dpt": (_auto("dpt"), "image"),
    "aimv2_vision_model": (_auto("aimv2_vision_model"), "image"),
    "dinov2_with_registers": (lambda: T.Dinov2WithRegistersModel(T.Dinov2WithRegistersConfig(
        **{k: v for k, v in _VIS.items() if k != "intermediate_size"}, mlp_ratio=2, num_register_tokens=2)), "image"),
    "dinov3_vit": (lambda: T.DINOv3ViTModel(T.DINOv3ViTConfig(**_VIS)), "image"),
    "chinese_clip_vision_model": (_auto("chinese_clip_vision_model"), "image"),
    # audio encoders
    "data2vec-audio": (lambda: T.Data2VecAudioModel(T.Data2VecAudioConfig(
        **{**_WAVE, "num_conv_pos_embeddings": 2}, conv_pos_kernel_size=3)), "wave"),
    "wav2vec2-conformer": (lambda: T.Wav2Vec2ConformerModel(T.Wav2Vec2ConformerConfig(**_WAVE)), "wave"),
    "unispeech-sat": (lambda: T.UniSpeechSatModel(T.UniSpeechSatConfig(**_WAVE)), "wave"),
    "sew-d": (lambda: T.SEWDModel(T.SEWDConfig(**_WAVE, squeeze_factor=1, position_buckets=8,
                                               max_position_embeddings=POS)), "wave"),
    # encoder-decoders
    "switch_transformers": (lambda: T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
        vocab_size=V, d_model=E, d_kv=D, d_ff=FF, num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=H,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=2, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager")), "seq2seq"),
}
# types headlab refuses (all but splinter compute attention in their own modules), each with the words of its
# refusal: the check that failed (splinter, fsmt), the op headlab cannot follow, or what structure found
OWN_REFUSED = {
    "deberta": (_auto("deberta", relative_attention=True, max_relative_positions=8, pos_att_type=["c2p", "p2c"],
                      pad_token_id=0), "op headlab cannot follow|computes the values"),
    "xlm": (_auto("xlm", emb_dim=E, pad_index=1), "list of their own"),
    "flaubert": (_auto("flaubert", emb_dim=E, pad_index=1), "list of their own"),
    "openai-gpt": (_auto("openai-gpt", n_positions=POS), "mul on the attention scores"),
    "ibert": (_auto("ibert", pad_token_id=1), "'ibert'"),
    "gpt_neox_japanese": (_auto("gpt_neox_japanese"), "a softmax over scores headlab did not follow"),
    "yoso": (_auto("yoso", pad_token_id=1), "own modules"),
    "mra": (_auto("mra", pad_token_id=1), "own modules|themselves"),
    "nystromformer": (_auto("nystromformer", segment_means_seq_len=POS, num_landmarks=POS, pad_token_id=1),
                      "reads the attention output"),
    "longformer": (_auto("longformer", attention_window=4, pad_token_id=1), "a softmax over scores headlab did not"),
    "cpmant": (_auto("cpmant", dim_model=E, dim_head=D, dim_ff=FF, num_layers=LAYERS, vocab_size=V),
               "failed the load-time check 'pattern'"),
    "convbert": (_auto("convbert", embedding_size=E, pad_token_id=1),
                 "op headlab cannot follow|reads the attention output"),
    "canine": (_auto("canine", num_hash_buckets=97, local_transformer_stride=4), "'canine'"),
    "splinter": (_auto("splinter", pad_token_id=0), "'pattern'"),
    "fsmt": (_auto("fsmt", src_vocab_size=V, tgt_vocab_size=V, langs=["en", "de"], pad_token_id=1), "'values'"),
    "fnet": (_auto("fnet", pad_token_id=1), "own modules|themselves"),
    "squeezebert": (_auto("squeezebert", embedding_size=E, q_groups=1, k_groups=1, v_groups=1, post_attention_groups=1,
                          intermediate_groups=1, output_groups=1, pad_token_id=0), "'squeezebert'"),
    "funnel": (lambda: T.FunnelModel(T.FunnelConfig(vocab_size=V, block_sizes=[1, 1], num_decoder_layers=1, d_model=E,
                                                    n_head=H, d_head=D, d_inner=FF, attn_implementation="eager")),
               "a softmax over scores headlab did not follow"),
    "prophetnet": (lambda: T.ProphetNetModel(T.ProphetNetConfig(
        vocab_size=V, hidden_size=E, num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
        num_encoder_attention_heads=H, num_decoder_attention_heads=H, encoder_ffn_dim=FF, decoder_ffn_dim=FF, ngram=2,
        max_position_embeddings=POS, pad_token_id=1, decoder_start_token_id=2, attn_implementation="eager")),
        "a softmax over scores headlab did not follow"),
    "xlnet": (lambda: T.XLNetModel(T.XLNetConfig(vocab_size=V, d_model=E, n_layer=LAYERS, n_head=H, d_inner=FF,
                                                 attn_implementation="eager")), "a softmax over scores headlab did not"),
    "wavlm": (lambda: T.WavLMModel(T.WavLMConfig(**_WAVE, num_buckets=8)), "own modules|themselves"),
}
OWN_TYPES = list(OWN_BUILDERS) + list(OWN_REFUSED)  # the types this block adds to the sweep
# the slower of them, and those whose structure another swept type already shows (BERT, ViT, wav2vec2, T5 kin): their
# every-step test runs with `make test-slow` only (test_structure adapts and checks each at load in the default run)
SLOW = {"tapas", "megatron-bert", "visual_bert", "roberta-prelayernorm", "roc_bert", "bert-generation", "ctrl",
        "phimoe", "persimmon", "dpt", "ijepa", "chinese_clip_vision_model", "dinov3_vit", "data2vec-vision",
        "data2vec-audio", "unispeech-sat", "wav2vec2-conformer", "switch_transformers"}
STRUCTURE_BUILDERS.update(OWN_BUILDERS)
REFUSED_BY_STRUCTURE.update(OWN_REFUSED)
# --- end of own-module attention

# --- variants (helper "variants", issue 40 item 4): a scaled residual branch (a residual multiplier, LayerScale)
# with a scale that is not one, so residual-mode norms must decompose it; encoder-decoders with bucketed relative
# attention whose cross-attention reads `encoder_hidden_states` (UMT5) or that no sweep named (Pop2Piano); LongT5's
# blocked local attention refused with its reason
_T5ISH = dict(num_decoder_layers=LAYERS, d_kv=D, d_ff=FF, relative_attention_num_buckets=8, decoder_start_token_id=0,
              pad_token_id=0)
VARIANT_BUILDERS = {
    "granitemoeshared": (_llama_like(T.GraniteMoeSharedConfig, T.GraniteMoeSharedForCausalLM, num_local_experts=2,
                                     num_experts_per_tok=1, shared_intermediate_size=16, residual_multiplier=0.5),
                         "text"),
    "internvl_vision": (_auto("internvl_vision", layer_scale_init_value=0.5, image_size=[16, 16], patch_size=[4, 4]),
                        "image"),
    "umt5": (lambda: T.UMT5ForConditionalGeneration(T.UMT5Config(
        vocab_size=V, d_model=E, num_layers=LAYERS, num_heads=H, attn_implementation="eager", **_T5ISH)), "seq2seq"),
    "pop2piano": (lambda: T.Pop2PianoForConditionalGeneration(T.Pop2PianoConfig(
        vocab_size=V, d_model=E, d_kv=D, d_ff=FF, num_layers=LAYERS, num_heads=H, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager")), "seq2seq"),
}
VARIANT_REFUSED = {
    "longt5": (_auto("longt5", **_T5ISH, encoder_attention_type="local", local_radius=2),
               "local / transient-global attention over blocks"),
}
STRUCTURE_BUILDERS.update(VARIANT_BUILDERS)
REFUSED_BY_STRUCTURE.update(VARIANT_REFUSED)
# --- end of variants

DECLARED = list(BUILDERS)
STRUCTURE = list(STRUCTURE_BUILDERS)
BUILDERS.update(STRUCTURE_BUILDERS)
NAMES = list(BUILDERS)


def build(name: str) -> torch.nn.Module:
    """The tiny model of architecture ``name``, with non-trivial norms and biases, in eval mode."""
    torch.manual_seed(0)
    model = (BUILDERS[name][0] if name in BUILDERS else REFUSED_BY_STRUCTURE[name][0])().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            low = n.lower()
            if n.endswith("bias") or "bias_table" in low or "norm" in low or "ln" in low.split(".")[-2:-1][0:1] or low.endswith(
                    ("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def inputs(name: str, *, padded: bool = True, length: int = 11) -> dict:
    """A batch of two for architecture ``name``; the second row right-padded when ``padded``."""
    g = torch.Generator().manual_seed(1)
    kind = BUILDERS[name][1]
    if kind == "image":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    if kind == "wave":
        return {"input_values": torch.randn(2, 400, generator=g)}
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
