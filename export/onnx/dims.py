"""The graphs' model constants, read off a bundle's `ModelConfig`."""

from __future__ import annotations

from cosyvoice_graphs import ModelDims

from ..config import ModelConfig


def model_dims(cfg: ModelConfig) -> ModelDims:
    """`ModelDims` of the model `cfg` describes."""
    q = cfg.llm.qwen
    return ModelDims(
        llm_hidden=q.hidden_size,
        llm_layers=q.num_hidden_layers,
        llm_kv_heads=q.num_key_value_heads,
        llm_head_dim=q.head_dim,
        speech_vocab=cfg.llm.speech_vocab,
        speech_token_size=cfg.llm.speech_token_size,
        mel_bins=cfg.flow.output_size,
        spk_embed_dim=cfg.flow.spk_embed_dim,
        pre_lookahead_len=cfg.flow.pre_lookahead_len,
        token_mel_ratio=cfg.flow.token_mel_ratio,
        dit_block_frames=cfg.flow.dit.static_chunk_size,
        dit_dim=cfg.flow.dit.dim,
        dit_depth=cfg.flow.dit.depth,
        dit_heads=cfg.flow.dit.heads,
        dit_head_dim=cfg.flow.dit.dim_head,
        dit_conv_kernel=cfg.flow.dit.conv_pos_kernel,
        harmonics=cfg.hift.nb_harmonics + 1,
        samples_per_frame=cfg.hift.upsample_scale,
        sample_rate=cfg.sample_rate,
    )
