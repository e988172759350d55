"""Hardware bounds of the two heavy stages, from the model's shapes as the bundle states them.

- LLM decode: every weight of the `llm` graph is read once per token, plus the KV cache so far; the
  bound is those bytes / measured memory bandwidth.
- DiT: the FLOPs of one `flow_estimator_cached` call with nothing cached (one ODE step, both CFG
  rows) at a frame count, full attention; the bound is those FLOPs / measured matmul GFLOP/s: float32
  `MatMul`'s, and for an int8 DiT the int8 rate for the blocks' weight matmuls (the rest stays float32).
- HiFT: the FLOPs of the vocoder's convolutions over the generated mel frames, at the same measured
  matmul GFLOP/s (onnxruntime runs a convolution as im2col + the same GEMM); its elementwise work (the
  Snake activations' sines) comes on top.

The shapes come from the runtime bundle's copy of the model yaml and the Qwen config (`tokenizer/`),
read with the exporter's torch-free yaml reader, so the counts are those of the exported networks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cosyvoice_export.bundle.yaml_config import model_config_from_yaml
from cosyvoice_export.config import DiTConfig, HiFTConfig, Qwen2Config
from cosyvoice_graphs import DIT, HIFT_DECODER
from cosyvoice_graphs.precision import BF16, FP32, INT8, Precision
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.runners import CPU, decode_body

from .backend import Figures
from .machine import Rates

"""The graphs the three bounds are of."""


@dataclass(frozen=True)
class ModelShapes:
    """The shapes the bounds are counted from, and the precision each bounded graph runs at."""

    qwen: Qwen2Config
    dit: DiTConfig
    hift: HiFTConfig
    speech_vocab: int
    llm_precision: Precision
    dit_precision: Precision
    hift_precision: Precision

    @classmethod
    def of(cls, bundle: RuntimeBundle, provider: str = CPU) -> ModelShapes:
        """Read from `bundle`'s model yaml, Qwen config and manifest, for a run on `provider`."""
        config = model_config_from_yaml(bundle.root / bundle.manifest.config,
                                        bundle.tokenizer_dir / "config.json")
        return cls(config.llm.qwen, config.flow.dit, config.hift, bundle.dims.speech_vocab,
                   bundle.graph_precision(decode_body(bundle, provider)), bundle.graph_precision(DIT),
                   bundle.graph_precision(HIFT_DECODER))


def llm_weight_count(qwen: Qwen2Config, speech_vocab: int) -> int:
    """Weights of the `llm` graph: the Qwen2 layers and final norm (its embedding table and 151,936-way
    `lm_head` are not in the graph) and `llm_decoder` (hidden -> speech_vocab, no bias)."""
    d, inner, kv = qwen.hidden_size, qwen.num_attention_heads * qwen.head_dim, qwen.num_key_value_heads
    kv_width = kv * qwen.head_dim
    attention = d * inner + inner + 2 * (d * kv_width + kv_width) + inner * d  # q, k, v with bias; o
    mlp = 3 * d * qwen.intermediate_size  # gate, up, down
    layer = attention + mlp + 2 * d  # two RMSNorms
    return qwen.num_hidden_layers * layer + d + d * speech_vocab


def llm_bytes_per_token(shapes: ModelShapes, past_len: float, precision: Precision | None = None) -> float:
    """Bytes a decode step reads at a cache of `past_len` positions: all weights at `precision`'s bytes
    per weight (default: the llm graph's; int8 and int4: their scales and float32 output head, 2% of the
    full-size llm's weights, are not counted) plus keys and values (float32) of every layer."""
    q = shapes.qwen
    kv_bytes = 2 * q.num_hidden_layers * q.num_key_value_heads * q.head_dim * past_len * 4
    weight_bytes = (precision or shapes.llm_precision).weight_bytes
    return llm_weight_count(q, shapes.speech_vocab) * weight_bytes + kv_bytes


def dit_flops_per_step(dit: DiTConfig, frames: int, batch: int = 2) -> int:
    """FLOPs (2 per multiply-add) of one DiT evaluation over `frames` frames for a CFG batch of 2, full
    attention: input projection, conv position embedding, per block q/k/v/o, scores and weighted sum and
    the feed-forward, then the output projection. The time embedding and AdaLN modulation are not computed
    per call: the graph holds them per Euler step."""
    t, d, inner, ff = frames, dit.dim, dit.heads * dit.dim_head, dit.dim * dit.ff_mult
    per_frame_in = 2 * dit.mel_dim + dit.mu_dim + dit.spk_dim
    macs = t * per_frame_in * d  # input projection
    macs += 2 * t * d * (d // dit.conv_pos_groups) * dit.conv_pos_kernel  # two grouped convs
    block = 4 * t * d * inner  # q, k, v, out
    block += 2 * t * t * inner  # q k^T and attention-weighted v over all heads
    block += 2 * t * d * ff  # feed-forward in and out
    macs += dit.depth * block
    macs += t * d * dit.out_channels  # output projection
    return 2 * batch * macs


def dit_int8_flops_per_step(dit: DiTConfig, frames: int, batch: int = 2) -> int:
    """Of `dit_flops_per_step`: the blocks' weight matmuls (q, k, v, out and the feed-forward), which an int8
    DiT multiplies in int8. Attention's activation matmuls, the convolutions, the input and output
    projections stay float32 (the exporter's int8 scheme)."""
    t, d, inner, ff = frames, dit.dim, dit.heads * dit.dim_head, dit.dim * dit.ff_mult
    return 2 * batch * dit.depth * (4 * t * d * inner + 2 * t * d * ff)


def dit_bound_s(dit: DiTConfig, frames: int, precision: Precision, rates: Rates) -> float:
    """Seconds of one ODE step at the measured rates for `precision`: int8 runs its weight matmuls at the
    int8 rate and the rest at float32's; every other precision all at its own matmul rate where measured
    (a GPU's tf32 and fp16), else at float32's (`Rates.matmul_rate`)."""
    total = dit_flops_per_step(dit, frames)
    if precision != INT8:
        return total / (rates.matmul_rate(precision)[0] * 1e9)
    if rates.int8_matmul_gflops is None:
        raise ValueError("an int8 DiT's bound needs the int8 matmul rate")
    quantized = dit_int8_flops_per_step(dit, frames)
    return (total - quantized) / (rates.matmul_gflops * 1e9) + quantized / (rates.int8_matmul_gflops * 1e9)


def needs_int8_rate(shapes: ModelShapes) -> bool:
    """Whether a bound runs at the int8 matmul rate (the DiT in int8)."""
    return shapes.dit_precision == INT8


def needs_bf16_rate(shapes: ModelShapes) -> bool:
    """Whether a bound runs at OpenVINO's bf16 matmul rate (the DiT or HiFT's decoder in bf16; the LLM's
    bound is its bytes read)."""
    return BF16 in (shapes.dit_precision, shapes.hift_precision)


def hift_flops(hift: HiFTConfig, frames: int) -> int:
    """FLOPs (2 per multiply-add) of the vocoder's GEMM-shaped work over `frames` mel frames: the F0
    predictor, the NSF source's harmonic mix, conv_pre, each stage's upsampling (as the exported polyphase
    conv, 3-5x fewer multiply-adds than the repeat-then-conv upstream runs), source downsampling
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
        # nearest upsampling then a conv of `kernel`, as the exported graph runs it: one polyphase conv at
        # the input's rate, `rate` phases of ceil((kernel - 1) / rate) + 1 taps each
        out = channels // 2
        macs += length * channels * out * rate * (-(-(kernel - 1) // rate) + 1)
        length *= rate
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


def rate_description(precision: Precision, rates: Rates) -> str:
    """What `dit_bound_s` divides by for `precision`, as the report prints it."""
    if precision == INT8:
        return "int8 DynamicQuantizeMatMul for the blocks' weight matmuls, float32 MatMul for the rest"
    return rates.matmul_rate(precision)[1]


def fraction_of_bound(bound_s: float | None, measured_s: float | None) -> float | None:
    """bound / measured: 1.0 is running at the hardware bound."""
    if bound_s is None or not measured_s:
        return None
    return bound_s / measured_s


def stage_bounds(shapes: ModelShapes, frames: int, vocoded_frames: int, decode_past: int, rates: Rates,
                 rt: Figures, th: Figures | None) -> dict[str, Any]:
    """The LLM, DiT and HiFT bounds of a case at `rates` and the fraction of each that the runtime (`rt`,
    at its graphs' precisions) and the torch reference (`th`, float32) reach. `frames`: the DiT's (prompt
    and generated); `vocoded_frames`: HiFT's (generated only)."""
    llm_bytes = llm_bytes_per_token(shapes, decode_past)
    llm_bound = llm_bytes / (rates.bandwidth_gbs * 1e9)
    llm_bound_fp32 = llm_bytes_per_token(shapes, decode_past, FP32) / (rates.bandwidth_gbs * 1e9)
    dit_flops = dit_flops_per_step(shapes.dit, frames)
    dit_bound = dit_bound_s(shapes.dit, frames, shapes.dit_precision, rates)
    dit_bound_fp32 = dit_bound_s(shapes.dit, frames, FP32, rates)
    vocoder_flops = hift_flops(shapes.hift, vocoded_frames)
    hift_gflops, hift_rate = rates.matmul_rate(shapes.hift_precision)
    hift_bound = vocoder_flops / (hift_gflops * 1e9)

    def reached(bound: float, key: str, figures: Figures | None) -> float | None:
        value = figures.get(key) if figures is not None else None
        return fraction_of_bound(bound, float(value) if value is not None else None)

    return {
        "threads": rates.threads, "device": rates.device,
        "llm_precision": shapes.llm_precision.name, "llm_weight_bytes": shapes.llm_precision.weight_bytes,
        "llm_decode_past_len": decode_past, "llm_bytes_per_token": llm_bytes,
        "memory_bandwidth_gbs": rates.bandwidth_gbs, "llm_bound_s_per_token": llm_bound,
        "llm_bound_fp32_s_per_token": llm_bound_fp32,
        "llm_fraction_runtime": reached(llm_bound, "llm_per_token_s", rt),
        "llm_fraction_torch": reached(llm_bound_fp32, "llm_per_token_s", th),
        "dit_precision": shapes.dit_precision.name, "dit_rate": rate_description(shapes.dit_precision, rates),
        "dit_gflops": (rates.matmul_rate(shapes.dit_precision)[0] if shapes.dit_precision != INT8
                       else rates.matmul_gflops),
        "frames": frames, "dit_flops_per_step": dit_flops,
        "dit_int8_flops_per_step": (dit_int8_flops_per_step(shapes.dit, frames) if needs_int8_rate(shapes)
                                    else None),
        "matmul_shape": list(rates.matmul_shape), "matmul_gflops": rates.matmul_gflops,
        "int8_matmul_gflops": rates.int8_matmul_gflops, "precision_gflops": dict(rates.precision_gflops),
        "dit_bound_s_per_step": dit_bound, "dit_bound_fp32_s_per_step": dit_bound_fp32,
        "dit_fraction_runtime": reached(dit_bound, "flow_per_step_s", rt),
        "dit_fraction_torch": reached(dit_bound_fp32, "flow_per_step_s", th),
        "hift_precision": shapes.hift_precision.name,
        "hift_frames": vocoded_frames, "hift_flops": vocoder_flops, "hift_rate": hift_rate,
        "hift_gflops": hift_gflops, "hift_bound_s": hift_bound,
        "hift_fraction_runtime": reached(hift_bound, "hift_s", rt),
        "hift_fraction_torch": reached(hift_bound, "hift_s", th),
    }
