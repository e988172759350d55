"""Hardware bounds of the two heavy stages, from the model's shapes as the bundle states them.

- LLM decode: every weight of the `llm` graph is read once per token, plus the KV cache so far; the
  bound is those bytes / measured memory bandwidth.
- DiT: the FLOPs of one `flow_estimator_cached` call with nothing cached (one ODE step, both CFG
  rows) at a frame count, full attention; the bound is those FLOPs / measured matmul GFLOP/s.
- HiFT: the FLOPs of the vocoder's convolutions over the generated mel frames, at the same measured
  matmul GFLOP/s (onnxruntime runs a convolution as im2col + the same GEMM); its elementwise work (the
  Snake activations' sines) comes on top.

The shapes come from the runtime bundle's copy of the model yaml and the Qwen config (`tokenizer/`),
read with the exporter's torch-free yaml reader, so the counts are those of the exported networks.
"""

from __future__ import annotations

from dataclasses import dataclass

from cosyvoice_export.bundle.yaml_config import model_config_from_yaml
from cosyvoice_export.config import DiTConfig, HiFTConfig, Qwen2Config
from cosyvoice_runtime.bundle import RuntimeBundle


@dataclass(frozen=True)
class ModelShapes:
    """The shapes the bounds are counted from."""

    qwen: Qwen2Config
    dit: DiTConfig
    hift: HiFTConfig
    speech_vocab: int
    llm_weight_dtype_bytes: int

    @classmethod
    def of(cls, bundle: RuntimeBundle) -> ModelShapes:
        """Read from `bundle`'s model yaml and Qwen config."""
        config = model_config_from_yaml(bundle.root / bundle.manifest.config,
                                        bundle.tokenizer_dir / "config.json")
        # int8: its scales and float32 output head (2% of the full-size llm's weights) are not counted
        return cls(config.llm.qwen, config.flow.dit, config.hift, bundle.dims.speech_vocab,
                   bundle.graph_precision("llm").weight_bytes)


def llm_weight_count(qwen: Qwen2Config, speech_vocab: int) -> int:
    """Weights of the `llm` graph: the Qwen2 layers and final norm (its embedding table and 151,936-way
    `lm_head` are not in the graph) and `llm_decoder` (hidden -> speech_vocab, no bias)."""
    d, inner, kv = qwen.hidden_size, qwen.num_attention_heads * qwen.head_dim, qwen.num_key_value_heads
    kv_width = kv * qwen.head_dim
    attention = d * inner + inner + 2 * (d * kv_width + kv_width) + inner * d  # q, k, v with bias; o
    mlp = 3 * d * qwen.intermediate_size  # gate, up, down
    layer = attention + mlp + 2 * d  # two RMSNorms
    return qwen.num_hidden_layers * layer + d + d * speech_vocab


def llm_bytes_per_token(shapes: ModelShapes, past_len: float) -> float:
    """Bytes a decode step reads at a cache of `past_len` positions: all weights plus keys and values
    (float32) of every layer."""
    q = shapes.qwen
    kv_bytes = 2 * q.num_hidden_layers * q.num_key_value_heads * q.head_dim * past_len * 4
    return llm_weight_count(q, shapes.speech_vocab) * shapes.llm_weight_dtype_bytes + kv_bytes


def dit_flops_per_step(dit: DiTConfig, frames: int, batch: int = 2) -> int:
    """FLOPs (2 per multiply-add) of one DiT evaluation over `frames` frames for a CFG batch of 2, full
    attention: input projection, conv position embedding, per block q/k/v/o, scores and weighted sum, the
    feed-forward and the AdaLN modulation, then the final modulation and output projection, and the
    time embedding."""
    t, d, inner, ff = frames, dit.dim, dit.heads * dit.dim_head, dit.dim * dit.ff_mult
    per_frame_in = 2 * dit.mel_dim + dit.mu_dim + dit.spk_dim
    macs = t * per_frame_in * d  # input projection
    macs += 2 * t * d * (d // dit.conv_pos_groups) * dit.conv_pos_kernel  # two grouped convs
    block = 4 * t * d * inner  # q, k, v, out
    block += 2 * t * t * inner  # q k^T and attention-weighted v over all heads
    block += 2 * t * d * ff  # feed-forward in and out
    block += d * 6 * d  # AdaLayerNormZero (once per row, not per frame)
    macs += dit.depth * block
    macs += d * 2 * d + t * d * dit.out_channels  # final modulation, output projection
    macs += dit.time_embed_dim * d + d * d  # time embedding MLP
    return 2 * batch * macs


def hift_flops(hift: HiFTConfig, frames: int) -> int:
    """FLOPs (2 per multiply-add) of the vocoder's GEMM-shaped work over `frames` mel frames: the F0
    predictor, the NSF source's harmonic mix, conv_pre, each stage's upsampling conv, source downsampling
    conv and residual blocks (two convs per dilation), and conv_post. The elementwise work (Snake's sines,
    the source's sines and noise, STFT and iSTFT) is not counted."""
    f0 = hift.f0
    macs = frames * f0.in_channels * f0.cond_channels * 4 + 4 * frames * f0.cond_channels ** 2 * 3
    macs += frames * hift.upsample_scale * (hift.nb_harmonics + 1)  # l_linear, per sample
    macs += frames * hift.in_channels * hift.base_channels * (hift.conv_pre_look_right + 1)
    stft_frames = frames * hift.upsample_scale // hift.istft_hop_len + 1  # centred STFT of the source
    spectrum = hift.istft_n_fft + 2  # real and imaginary halves
    length, channels = frames, hift.base_channels
    stages = zip(hift.upsample_rates, hift.upsample_kernel_sizes, hift.source_resblock_kernel_sizes,
                 hift.source_resblock_dilation_sizes, strict=True)
    for i, (rate, kernel, source_kernel, source_dilations) in enumerate(stages):
        length, out = length * rate, channels // 2
        macs += length * channels * out * kernel  # nearest upsampling, then a stride-1 conv
        # the source STFT, downsampled to this stage's length: a strided conv of kernel 2 * stride, which
        # is stft_frames * spectrum * 2 multiply-adds per output channel whatever the stride (1: 1x1 conv)
        macs += stft_frames * spectrum * out * (1 if i == len(hift.upsample_rates) - 1 else 2)
        macs += 2 * len(source_dilations) * length * out * out * source_kernel
        for kernel_j, dilations in zip(hift.resblock_kernel_sizes, hift.resblock_dilation_sizes, strict=True):
            macs += 2 * len(dilations) * length * out * out * kernel_j
        channels = out
    macs += stft_frames * channels * spectrum * 7  # conv_post
    return 2 * macs


def dit_matmul_shape(dit: DiTConfig, frames: int, batch: int = 2) -> tuple[int, int, int]:
    """(m, k, n) of the DiT's largest matmul, the feed-forward's first layer, for `matmul_gflops`."""
    return batch * frames, dit.dim, dit.dim * dit.ff_mult


def fraction_of_bound(bound_s: float | None, measured_s: float | None) -> float | None:
    """bound / measured: 1.0 is running at the hardware bound."""
    if bound_s is None or not measured_s:
        return None
    return bound_s / measured_s
