"""Hyperparameters of the three CosyVoice3 networks.

Every value a network needs is a field here; `bundle.yaml_config` fills these from a bundle's
`cosyvoice3.yaml` and `CosyVoice-BlankEN/config.json`, and `full_size()` / `tiny()` are the two
presets our own bundles are written from. Values that upstream hard-codes in Python rather than in
the yaml are defaults here, with the upstream location named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Settings the torch-free runtime consumes too are defined once, there.
from cosyvoice_runtime.frontend.features import PromptMelConfig as MelConfig
from cosyvoice_runtime.sampling import RasConfig as RASConfig


@dataclass(frozen=True)
class Qwen2Config:
    """The Qwen2 backbone, as read from `CosyVoice-BlankEN/config.json`."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Qwen2Config:
        """Take the fields we use from an HF config dict; unknown keys are ignored."""
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "intermediate_size", "vocab_size") if k not in d]
        if missing:
            raise KeyError(f"missing {', '.join(missing)}")
        return cls(
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d["num_key_value_heads"]),
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        )

    @classmethod
    def from_json(cls, path: Path) -> Qwen2Config:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF `config.json` for this backbone, in the style of Qwen2.5-0.5B's."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen2",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.3",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }


@dataclass(frozen=True)
class LLMConfig:
    """`CosyVoice3LM` around the Qwen2 backbone."""

    qwen: Qwen2Config
    llm_input_size: int
    llm_output_size: int
    speech_token_size: int = 6561
    sampling: RASConfig = field(default_factory=RASConfig)
    extra_speech_ids: int = 200
    """Rows after the speech codebook: sos, eos, task_id, fill and unused stop ids (llm.py:681-703)."""

    @property
    def sos(self) -> int:
        return self.speech_token_size

    @property
    def eos(self) -> int:
        return self.speech_token_size + 1

    @property
    def task_id(self) -> int:
        return self.speech_token_size + 2

    @property
    def fill(self) -> int:
        return self.speech_token_size + 3

    @property
    def speech_vocab(self) -> int:
        """Rows of `speech_embedding` and outputs of `llm_decoder`."""
        return self.speech_token_size + self.extra_speech_ids


@dataclass(frozen=True)
class DiTConfig:
    """The flow decoder's estimator (`cosyvoice.flow.DiT.dit.DiT`)."""

    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: int
    mel_dim: int
    mu_dim: int
    spk_dim: int
    out_channels: int
    static_chunk_size: int
    """Frames per block of the block-causal streaming mask (chunk_size * token_mel_ratio)."""
    conv_pos_kernel: int = 31
    conv_pos_groups: int = 16
    time_embed_dim: int = 256


@dataclass(frozen=True)
class CFMConfig:
    """The conditional flow-matching sampler (`CausalConditionalCFM`)."""

    inference_cfg_rate: float = 0.7
    t_scheduler: str = "cosine"
    n_timesteps: int = 10
    """Hard-coded in `CausalMaskedDiffWithDiT.inference` (flow.py:404-411)."""
    noise_frames: int = 15000
    """Length of the seed-0 noise table drawn at construction (flow_matching.py:199-200)."""


@dataclass(frozen=True)
class FlowConfig:
    """`CausalMaskedDiffWithDiT`: token embedding, speaker projection, pre-lookahead, CFM + DiT."""

    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    token_mel_ratio: int
    pre_lookahead_len: int
    pre_lookahead_channels: int
    dit: DiTConfig
    cfm: CFMConfig = field(default_factory=CFMConfig)


@dataclass(frozen=True)
class F0PredictorConfig:
    """`CausalConvRNNF0Predictor`."""

    num_class: int = 1
    in_channels: int = 80
    cond_channels: int = 512


@dataclass(frozen=True)
class HiFTConfig:
    """`CausalHiFTGenerator` with its NSF source and F0 predictor."""

    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    istft_n_fft: int
    istft_hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    conv_pre_look_right: int
    f0: F0PredictorConfig
    noise_seconds: int = 300
    """SineGen2/SourceModuleHnNSF draw `sampling_rate * 300` samples of noise at construction."""

    @property
    def upsample_scale(self) -> int:
        """Samples per mel frame: prod(upsample_rates) * istft hop."""
        scale = self.istft_hop_len
        for r in self.upsample_rates:
            scale *= r
        return scale


@dataclass(frozen=True)
class ModelConfig:
    """Everything a bundle's yaml and Qwen config say about the model."""

    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    chunk_size: int
    llm: LLMConfig
    flow: FlowConfig
    hift: HiFTConfig
    feat: MelConfig


FULL_QWEN = Qwen2Config(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    max_position_embeddings=32768, tie_word_embeddings=True,
)


def _hift(base_channels: int, cond_channels: int) -> HiFTConfig:
    return HiFTConfig(
        in_channels=80, base_channels=base_channels, nb_harmonics=8, sampling_rate=24000,
        nsf_alpha=0.1, nsf_sigma=0.003, nsf_voiced_threshold=10.0,
        upsample_rates=(8, 5, 3), upsample_kernel_sizes=(16, 11, 7), istft_n_fft=16, istft_hop_len=4,
        resblock_kernel_sizes=(3, 7, 11), resblock_dilation_sizes=((1, 3, 5),) * 3,
        source_resblock_kernel_sizes=(7, 7, 11), source_resblock_dilation_sizes=((1, 3, 5),) * 3,
        lrelu_slope=0.1, audio_limit=0.99, conv_pre_look_right=4,
        f0=F0PredictorConfig(num_class=1, in_channels=80, cond_channels=cond_channels),
    )


def _model(qwen: Qwen2Config, dit: DiTConfig, pll_channels: int, hift: HiFTConfig) -> ModelConfig:
    return ModelConfig(
        sample_rate=24000, token_frame_rate=25, token_mel_ratio=2, chunk_size=25,
        llm=LLMConfig(qwen=qwen, llm_input_size=qwen.hidden_size, llm_output_size=qwen.hidden_size),
        flow=FlowConfig(
            input_size=80, output_size=80, spk_embed_dim=192, vocab_size=6561, token_mel_ratio=2,
            pre_lookahead_len=3, pre_lookahead_channels=pll_channels, dit=dit,
        ),
        hift=hift,
        feat=MelConfig(),
    )


def full_size() -> ModelConfig:
    """Fun-CosyVoice3-0.5B as released (example yaml + the BlankEN Qwen2.5-0.5B config)."""
    dit = DiTConfig(dim=1024, depth=22, heads=16, dim_head=64, ff_mult=2, mel_dim=80, mu_dim=80,
                    spk_dim=80, out_channels=80, static_chunk_size=50)
    return _model(FULL_QWEN, dit, pll_channels=1024, hift=_hift(512, 512))


def tiny(text_vocab_size: int) -> ModelConfig:
    """Same structure and I/O dims (80 mels, 6561 speech tokens, 24 kHz), tiny hidden sizes.

    `text_vocab_size` is the Qwen embedding rows, sized to the tiny tokenizer.
    """
    qwen = Qwen2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=text_vocab_size, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=True,
    )
    dit = DiTConfig(dim=64, depth=2, heads=4, dim_head=16, ff_mult=2, mel_dim=80, mu_dim=80,
                    spk_dim=80, out_channels=80, static_chunk_size=50, conv_pos_groups=16)
    return _model(qwen, dit, pll_channels=64, hift=_hift(32, 32))
