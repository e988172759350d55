"""The graphs of a CosyVoice3 runtime bundle, each one spec, sized by the model's dims.

A graph's I/O is written here and nowhere else: `spec(name, dims)` is what the exporter traces, the
validator checks, the TensorRT builder profiles and the runtime binds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from .precision import BF16, FP16, INT4, INT8
from .spec import (
    BATCH,
    Case,
    DecodeGates,
    DerivedDim,
    DimRange,
    GraphSpec,
    SolveGates,
    TensorSpec,
    Tolerance,
    cache_pairs,
)

OPSET = 17
FP16_REL_MAX = Tolerance("rel_max_abs", 1e-2)
INT8_LOGP = Tolerance("rel_max_abs", 5e-2)
INT8_CACHE = Tolerance("rel_max_abs", 1e-1)
INT8_DECODE_GATES = DecodeGates("logp", steps=200, mean_kl=2e-2, top_k=25, top_logp_error=1.0,
                                greedy_mismatches=30)
"""Loose against what the full-size random bundle measured (docs/export.md, "Tolerances and gates: what was
measured"): random weights flatten the distributions, which makes near-ties and so greedy flips common; a
trained LLM's are peakier."""
INT4_LOGP = Tolerance("rel_max_abs", 5e-1)
INT4_CACHE = Tolerance("rel_max_abs", 1.0)
INT4_DECODE_GATES = DecodeGates("logp", steps=200, mean_kl=1.0, top_k=25, top_logp_error=12.0,
                                greedy_mismatches=130)
"""Looser than int8's because 4 bits are: a 32-weight block of a Gaussian row gets 16 levels, and the random
weights pass the rounding through 24 layers undamped. 1.3x to 1.5x what the full-size random bundle
measured (docs/export.md, "Tolerances and gates: what was measured"): they catch a broken conversion, not
a loss a trained LLM would show, which needs its own figures."""
PREFILL_INT8_LOGP = Tolerance("rel_max_abs", 2e-1)
PREFILL_INT8_CACHE = Tolerance("rel_max_abs", 3e-1)
"""`llm_prefill`'s int8 (activations quantized per tensor, where `llm`'s int8 has a scale per 32 channels):
about twice what the full-size random bundle measured against the fp32 graph (docs/export.md, "Tolerances
and gates: what was measured")."""
PREFILL_INT8_DECODE_GATES = DecodeGates("logp", steps=200, mean_kl=7e-2, top_k=25, top_logp_error=2.0,
                                        greedy_mismatches=45)
"""`llm_prefill`'s int8 gates, run as `llm`'s are (its prefill and all 200 steps on it, though the runtime
only prefills on it): ~1.5x what the full-size random bundle measured (docs/export.md, "Tolerances and
gates: what was measured")."""
INT8_VELOCITY = Tolerance("rel_max_abs", 5e-2)
BF16_DIT = Tolerance("rel_max_abs", 3e-2)
"""bf16 keeps 8 significant bits, and OpenVINO runs nearly the whole DiT in it (matmuls, LayerNorms,
attention with its softmax, the residual stream), Sin and Cos apart: about twice the worst error measured
with OpenVINO on AVX512-BF16 (docs/export.md, "Tolerances and gates: what was measured")."""
SOLVE_GATES = SolveGates("velocity", frames=250, min_snr_db=30.0)
"""The int8 DiT's flow gate: the mel of a 10 s-scale solve within 30 dB of float32's."""
BF16_SOLVE_GATES = SolveGates("velocity", frames=250, min_snr_db=45.0)
"""The bf16 DiT's flow gate, some 8 dB below what OpenVINO on AVX512-BF16 measured (docs/export.md,
"Tolerances and gates: what was measured")."""


@dataclass(frozen=True)
class ModelDims:
    """The model constants the graphs' shapes depend on (stored in every graph's metadata)."""

    llm_hidden: int
    llm_layers: int
    llm_kv_heads: int
    llm_head_dim: int
    speech_vocab: int
    """Rows of `llm_decoder`: speech codebook + sos/eos/task_id/fill and the other stop ids."""
    speech_token_size: int
    """Speech codebook size; ids >= this are the special/stop ids."""
    mel_bins: int
    spk_embed_dim: int
    pre_lookahead_len: int
    token_mel_ratio: int
    dit_block_frames: int
    """Frames per block of the DiT's block-causal streaming mask."""
    dit_dim: int
    """Width of the DiT's residual stream (and of its conv position embedding)."""
    dit_depth: int
    """DiT blocks, each with one key/value cache pair in `flow_estimator_cached`."""
    dit_heads: int
    dit_head_dim: int
    dit_conv_kernel: int
    """Kernel of the DiT's two causal conv position-embedding layers (each reads kernel - 1 frames back)."""
    harmonics: int
    """Sine harmonics of the NSF source, fundamental included."""
    samples_per_frame: int
    sample_rate: int

    def to_metadata(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> ModelDims:
        return cls(**{k: int(meta[k]) for k in cls.__dataclass_fields__})


ODE_STEPS = 10
"""Euler steps of the flow's ODE (upstream hard-codes 10 in `flow.inference`)."""


def ode_time_grid(n_steps: int = ODE_STEPS) -> np.ndarray:
    """The n+1 ODE times (float32): linspace(0, 1) warped by 1 - cos(t π/2), as upstream's float32 ops.

    The cosine is evaluated in float64 and rounded, i.e. correctly rounded, which is what torch's
    float32 cos gives on this grid.
    """
    t = np.linspace(0, 1, n_steps + 1, dtype=np.float32)
    angle = t * np.float32(0.5) * np.float32(math.pi)
    return np.float32(1) - np.cos(angle.astype(np.float64)).astype(np.float32)


def euler_steps(n_steps: int = ODE_STEPS) -> list[tuple[np.float32, np.float32]]:
    """(t, dt) of each Euler step, float32, as upstream's `solve_euler` makes them: t accumulates the
    steps and each dt is re-read from the grid against it, so a t can be an ulp off its grid point.
    `flow_estimator_cached` holds the DiT's time modulation at these t, picked by `ode_step`."""
    grid = ode_time_grid(n_steps)
    t, dt = grid[0], grid[1] - grid[0]
    steps = []
    for step in range(1, n_steps + 1):
        steps.append((t, dt))
        t = t + dt
        if step < n_steps:
            dt = grid[step + 1] - t
    return steps


def _f32(name: str, shape: tuple[int | str, ...], doc: str = "", low: float = -1.0, high: float = 1.0
         ) -> TensorSpec:
    return TensorSpec(name, "float32", shape, doc, low, high)


LLM = "llm"
LLM_DECODE = "llm_decode"
"""The LLM's two decode bodies: `llm` runs everywhere, `llm_decode` on onnxruntime's CPU (and batches)."""
LLM_PREFILL = "llm_prefill"
"""The LLM's prefill body: `llm`'s function for the calls over many new positions."""
FLOW_ENCODER = "flow_encoder"
"""The flow's token encoder: speech tokens and the x-vector -> the DiT's conditioning."""
DIT = "flow_estimator_cached"
"""The flow's DiT estimator, the graph the ODE calls."""
HIFT_F0 = "hift_f0"
"""The vocoder's F0 predictor."""
HIFT_DECODER = "hift_decoder"
"""The vocoder's decoder (the f0 predictor is `hift_f0`)."""
PAST_LEN = "past_len"
"""The symbolic dim of the LLM graphs' caches: the positions cached (in `llm_decode`, a buffer's rows)."""


def llm_spec(d: ModelDims) -> GraphSpec:
    """Prefill and decode in one graph: a new block of embeddings attends to itself (causally) and to
    the cache. One graph serves both because the only difference is `new_len` (1 when decoding), and
    it keeps the weights in one file."""
    kv = (1, d.llm_kv_heads, PAST_LEN, d.llm_head_dim)
    present = (1, d.llm_kv_heads, "total_len", d.llm_head_dim)
    inputs = [_f32("inputs_embeds", (1, "new_len", d.llm_hidden),
                   "Embeddings of the new positions (text table, speech table rows, sos/task_id rows).")]
    outputs = [_f32("logp", (1, d.speech_vocab),
                    "log_softmax(llm_decoder(final-norm hidden)) at the last position.")]
    for i in range(d.llm_layers):
        inputs += [_f32(f"past_key_{i}", kv, f"Layer {i} keys after RoPE, positions 0..past_len-1."),
                   _f32(f"past_value_{i}", kv, f"Layer {i} values.")]
        outputs += [_f32(f"present_key_{i}", present), _f32(f"present_value_{i}", present)]
    return GraphSpec(
        name=LLM, version=1, opset=OPSET, doc=llm_spec.__doc__ or "",
        inputs=tuple(inputs), outputs=tuple(outputs),
        dims={"new_len": DimRange(1, 1, 1024), PAST_LEN: DimRange(0, 256, 2048)},
        derived={"total_len": DerivedDim({"new_len": 1, PAST_LEN: 1})},
        tolerances={o.name: Tolerance("max_abs", 1e-4) for o in outputs},
        trace=Case({"new_len": 5, PAST_LEN: 3}),
        validate=(Case({"new_len": 7, PAST_LEN: 0}), Case({"new_len": 1, PAST_LEN: 9}),
                  Case({"new_len": 4, PAST_LEN: 13})),
        # fp16 keeps 11 significant bits (roundoff 4.9e-4) and matmuls add a few per layer; 1e-2 of the
        # log-probs' scale barely moves sampling, and the cache is stored fp16-rounded.
        # int8: keys and values of the deepest layers reach 6.5e-2 of their scale at full size (random
        # weights, 24 layers of rounding); the log-probs 2.8e-2. The decode gates judge what matters.
        precision_tolerances={FP16.name: {o.name: FP16_REL_MAX for o in outputs},
                              INT8.name: {o.name: INT8_LOGP if o.name == "logp" else INT8_CACHE
                                          for o in outputs},
                              INT4.name: {o.name: INT4_LOGP if o.name == "logp" else INT4_CACHE
                                          for o in outputs}},
        decode_gates={INT8.name: INT8_DECODE_GATES, INT4.name: INT4_DECODE_GATES},
    )


def llm_prefill_spec(d: ModelDims) -> GraphSpec:
    """`llm` again, for its calls over many new positions (a request's prefill): the same function and
    I/O, in a body that is fastest there. Optional (`OPTIONAL_SPECS`): a bundle has it where its
    precision plan names it, and the runtime then runs the calls over many new positions on it (from 4:
    `cosyvoice_runtime.llm.PREFILL_BODY_FROM`) and the decode steps on `llm` (the caches pass from one to
    the other as they are).

    Its only body is int8 with onnxruntime's dynamic quantization (`DynamicQuantizeMatMul`: int8
    weights per output channel, activations per tensor), whose integer GEMM runs a prefill's hundreds of
    rows near the CPU's int8 rate, where the decode graph's `MatMulNBits` runs them at a third of it
    (docs/performance-log.md); for one row it is slower, hence the decode stays on `llm`."""
    llm = llm_spec(d)
    prefill = {o.name: PREFILL_INT8_LOGP if o.name == "logp" else PREFILL_INT8_CACHE for o in llm.outputs}
    return replace(
        llm, name=LLM_PREFILL, doc=llm_prefill_spec.__doc__ or "",
        # tuned (TensorRT's opt, `cosyvoice-run --tune`) for a prefill: prompt and sentence, nothing cached
        dims={"new_len": DimRange(1, 250, 1024), PAST_LEN: DimRange(0, 0, 2048)},
        precision_tolerances={INT8.name: prefill}, decode_gates={INT8.name: PREFILL_INT8_DECODE_GATES},
    )


SEQLENS_K = "seqlens_k"
"""`llm_decode`'s input: per row, its cache's positions plus its new ones, minus one (`GroupQueryAttention`'s
input of that name, which it reads on the session's device)."""
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
"""`llm_decode`'s input: the rows' longest total (cache and new positions), or more up to the buffers' length
(`GroupQueryAttention`'s input of that name, which it reads on the host)."""
MAX_BATCH = 16
"""The largest batch `llm_decode`'s profile names (the server's `--max-batch` is at most this)."""


def llm_decode_spec(d: ModelDims) -> GraphSpec:
    """`llm` for onnxruntime (its CPU provider, and CUDA in fp16), with its caches in buffers written in
    place, and a batch of decodings per call. Row b of each `past_*` is a buffer whose first
    `seqlens_k[b] + 1 - new_len` rows hold that decoding's cache (its cache length); the graph writes its
    new positions' keys and values after them and returns the buffers as `present_*`,
    `max(past_len, total_sequence_length)` rows long (a row's rows after its own total are unspecified).
    Bound to the memory of `past_*` (onnxruntime's IOBinding), `present_*` are written in place: a decode
    step neither grows nor copies the cache. Every row takes `new_len` new positions (the runtime batches
    decode steps, one position each, and prefills alone). Rows are independent: a row's log-probs and cache
    do not depend on the others (on the CPU in float32, to the bit: tests/test_decode_batch.py). Fed one row
    and buffers of exactly its cache length, as its batch-1 cases are, it is `llm`: `present_*` have
    `total_len` rows.

    The lengths are inputs, `decode_lengths` computes them, and the graph has no arithmetic on them or on
    shapes: `GroupQueryAttention` reads `total_sequence_length` on the host and `seqlens_k` on the session's
    device, and onnxruntime captures a CUDA graph of a call only where no node copies between the two. Any
    `total_sequence_length` from the longest row's total up to the buffers' length computes the same rows
    (on the CPU to the bit: tests/test_llm_decode.py); a CUDA graph's replays keep the buffers' length.

    Attention is onnxruntime's `GroupQueryAttention` (com.microsoft), which applies RoPE from a table of
    the model's `max_position_embeddings` rows (the graph's metadata `max_positions`) at each row's own
    positions: one node per layer where `llm` has ~25. Its CUDA kernel computes in float16 only (of the
    precisions here), so the fp16 body's caches are float16 (`precision_dtypes`). Optional
    (`OPTIONAL_SPECS`): where a bundle's plan names it, the runtime runs the decode steps on it and not
    `llm` on onnxruntime's CPU, and on CUDA where it is fp16 (`pipeline.decode_body`); TensorRT and
    OpenVINO, which have no such operator, keep `llm`."""
    llm = llm_spec(d)

    def batched(t: TensorSpec) -> TensorSpec:
        return replace(t, shape=(BATCH, *t.shape[1:]))

    lengths = (TensorSpec(SEQLENS_K, "int32", (BATCH,), "Per row, its cache length plus new_len, minus one.",
                          0, 1),
               TensorSpec(TOTAL_SEQUENCE_LENGTH, "int32", (), "The longest row's cache length plus new_len, "
                          "or more, up to past_len.", 1, 2))
    inputs = (batched(llm.inputs[0]), *lengths, *(batched(t) for t in llm.inputs[1:]))

    def case(new: int, past: int, batch: int = 1) -> Case:
        return Case({BATCH: batch, "new_len": new, PAST_LEN: past}, _length_values((past,) * batch, new))

    return replace(
        llm, name=LLM_DECODE, version=3, doc=llm_decode_spec.__doc__ or "", inputs=inputs,
        outputs=tuple(batched(t) for t in llm.outputs),
        dims={BATCH: DimRange(1, 1, MAX_BATCH), **llm.dims},
        trace=case(5, 3, batch=2), validate=(case(7, 0), case(1, 9), case(4, 13), case(1, 11, batch=3)),
        # the attention reads and writes float16 buffers in place as it does float32 ones
        precision_dtypes={FP16.name: {name: "float16" for pair in cache_pairs(llm) for name in pair}},
        custom_opsets={"com.microsoft": 1},
    )


def decode_lengths(cache_len: Sequence[int] | np.ndarray, new_len: int, total: int | None = None
                   ) -> dict[str, np.ndarray]:
    """`llm_decode`'s length inputs for rows whose caches hold `cache_len[b]` positions, each taking
    `new_len` new ones: `seqlens_k` and `total_sequence_length`, the longest total or `total` (the
    buffers' length, which a CUDA graph's replays keep; not less than the longest)."""
    totals = np.asarray(cache_len, dtype=np.int64) + new_len
    longest = int(totals.max())
    if total is not None and total < longest:
        raise ValueError(f"{TOTAL_SEQUENCE_LENGTH} {total} is below the longest row's {longest} positions")
    return {SEQLENS_K: (totals - 1).astype(np.int32),
            TOTAL_SEQUENCE_LENGTH: np.array(longest if total is None else total, dtype=np.int32)}


def _length_values(cache_len: Sequence[int], new_len: int) -> dict[str, tuple[float, ...]]:
    """`decode_lengths` as a `Case`'s pinned values."""
    return {name: tuple(value.ravel().tolist()) for name, value in decode_lengths(cache_len, new_len).items()}


def decode_step_case(s: GraphSpec, past_len: int, *, batch: int = 1, room: int = 0) -> Case:
    """A decode step of `llm` or `llm_decode` after `past_len` cached positions: one new position (per row
    of `llm_decode`'s `batch`, each buffer holding its cache and `room` positions more: 1 or more, and its
    `present_*` can be written in place, as the runtime's are)."""
    if SEQLENS_K not in s.input_names:
        return Case({"new_len": 1, PAST_LEN: past_len})
    return Case({BATCH: batch, "new_len": 1, PAST_LEN: past_len + room},
                _length_values((past_len,) * batch, 1))


def flow_encoder_spec(d: ModelDims) -> GraphSpec:
    """Speech tokens (prompt + generated) -> the DiT's `mu`, and the x-vector -> `spks`.

    Non-final calls pass the 3 look-ahead tokens that follow `tokens`; a final call passes -1 for
    each, which stands for upstream's zero right-padding."""
    n = d.pre_lookahead_len
    return GraphSpec(
        name=FLOW_ENCODER, version=1, opset=OPSET, doc=flow_encoder_spec.__doc__ or "",
        inputs=(
            TensorSpec("tokens", "int64", (1, "tokens"), "Speech tokens, prompt first.",
                       0, d.speech_token_size),
            TensorSpec("lookahead_tokens", "int64", (1, n), "Next tokens, or -1 (none) on the final call.",
                       -1, d.speech_token_size),
            _f32("embedding", (1, d.spk_embed_dim), "CAM++ x-vector (not normalised).", -3.0, 3.0),
        ),
        outputs=(
            _f32("mu", (1, d.mel_bins, "frames"),
                 "Token embeddings after pre-lookahead, repeated to mel rate."),
            _f32("spks", (1, d.mel_bins), "Projected, L2-normalised x-vector."),
        ),
        dims={"tokens": DimRange(2, 250, 1500)},
        derived={"frames": DerivedDim({"tokens": d.token_mel_ratio})},
        tolerances={"mu": Tolerance("max_abs", 1e-4), "spks": Tolerance("max_abs", 1e-4)},
        trace=Case({"tokens": 11}),
        validate=(Case({"tokens": 37}), Case({"tokens": 5}, {"lookahead_tokens": (-1.0,) * n})),
        # conditioning for the DiT: 1e-2 relative is below the ODE's own sensitivity
        precision_tolerances={FP16.name: {"mu": FP16_REL_MAX, "spks": FP16_REL_MAX}},
    )


DIT_ROWS = "rows"
"""`flow_estimator_cached`'s rows: two per stream of its `BATCH` (a CFG pair)."""
DIT_PAST_FRAMES = "past_frames"
"""`flow_estimator_cached`'s cached frames: the dim of its key and value caches that grows chunk by chunk."""


def dit_frame_caches(spec: GraphSpec) -> tuple[list[TensorSpec], int]:
    """`flow_estimator_cached`'s caches with a frame per cached frame (the keys and values; the conv caches
    hold a fixed number) and their frames' axis."""
    pasts = {past for past, _ in cache_pairs(spec)}
    caches = [t for t in spec.inputs if t.name in pasts and DIT_PAST_FRAMES in t.shape]
    return caches, caches[0].shape.index(DIT_PAST_FRAMES)


def flow_estimator_cached_spec(d: ModelDims) -> GraphSpec:
    """The DiT velocity field for CFG pairs (row 2s conditional, row 2s + 1 with mu/spks/cond zeroed)
    over a call's new frames, the earlier frames given as caches.

    A call's `batch` pairs are streams at the same ODE step with the same frames: one `ode_step`,
    `positions`, `attention_mask`, new and cached frame counts. Rows are independent: a stream's rows
    stacked with others' give its velocity and caches alone (on the CPU in float32 at 2 threads to the bit,
    within 5.5e-6 on an H200: tests/test_dit_stacking.py).

    Per DiT block i, `past_key_i`/`past_value_i` hold the keys (after RoPE) and values of the cached
    frames and `present_*` those followed by the new frames'. `positions` are the new frames' places in the
    sequence (RoPE) and `attention_mask` which keys each new frame sees; `dit_attention` gives both for
    frames at offset .. offset + new_frames - 1 that see every cached key and, among themselves, query p
    key q iff q < (p // b + 1) * b (b = block_frames: 50 is upstream's block-causal streaming mask, and
    b >= offset + new_frames is full attention). They are inputs, not computed in the graph from an offset
    and the inputs' shapes, so that no node computes on integers or shapes: onnxruntime's CUDA provider
    would place such nodes on the CPU, and a graph with nodes there cannot be replayed from a CUDA graph.
    `past_pos_conv1/2` are the last kernel - 1 input frames of the causal conv position embedding's
    first and second conv (zeros before the first frame: upstream's left padding); `present_*` the
    same after the new frames. One set of caches per ODE step: the inputs differ between steps.
    The ODE time enters only through every AdaLN's shifts, scales and gates, a function of t alone:
    they are precomputed at the `ODE_STEPS` times of `euler_steps` (in float32 torch, as upstream
    computes them per call) and held in the graph, whose `ode_step` picks a row; their linears, 43% of
    the DiT's weights, are not in the graph.
    With nothing cached (`empty_caches`, positions from 0) a call is one DiT evaluation over all its frames:
    the offline flow, a stream's first chunk and its final re-run. Fed back chunk after chunk on
    boundaries of the block-causal mask (where no earlier frame sees a later one), the velocities equal
    one block-causal call over all frames."""
    # The conv position embedding's left context is carried as its two convs' input frames rather
    # than recomputed from the earlier frames' raw x/cond/mu: the zero padding applies to the conv
    # inputs (upstream pads the projected frames, not the raw ones), so zero caches reproduce it
    # exactly with no position test in the graph, nothing is computed twice, and the caches follow
    # the one past_/present_ rule.
    mel, ctx = d.mel_bins, d.dit_conv_kernel - 1
    kv = (DIT_ROWS, d.dit_heads, DIT_PAST_FRAMES, d.dit_head_dim)
    present = (DIT_ROWS, d.dit_heads, "total_frames", d.dit_head_dim)
    inputs = [
        _f32("x", (DIT_ROWS, mel, "new_frames"), "The ODE state of the new frames.", -3.0, 3.0),
        _f32("mu", (DIT_ROWS, mel, "new_frames"), "Encoder output (odd rows zeros).", -3.0, 3.0),
        TensorSpec("ode_step", "int64", (1,), "Index of the Euler step (`euler_steps`): the graph holds the "
                   "AdaLN modulation of each step's time, computed at export.", 0, ODE_STEPS),
        _f32("spks", (DIT_ROWS, mel), "Speaker projection (odd rows zeros)."),
        _f32("cond", (DIT_ROWS, mel, "new_frames"), "Prompt mel then zeros (odd rows zeros).", -8.0, 2.0),
        TensorSpec("positions", "int64", ("new_frames",), "Each new frame's place in the sequence (prompt "
                   "frames included): `dit_attention`.", 0, 1000),
        TensorSpec("attention_mask", "bool", ("new_frames", "total_frames"), "Whether new frame i sees key j "
                   "of [cached | new] (`dit_attention`); no row all False."),
    ]
    outputs = [_f32("velocity", (DIT_ROWS, mel, "new_frames"), "Estimated velocity of the new frames per "
                    "row.")]
    for conv in ("pos_conv1", "pos_conv2"):
        inputs.append(_f32(f"past_{conv}", (DIT_ROWS, d.dit_dim, ctx), f"Last {ctx} input frames of {conv}."))
        outputs.append(_f32(f"present_{conv}", (DIT_ROWS, d.dit_dim, ctx)))
    for i in range(d.dit_depth):
        inputs += [_f32(f"past_key_{i}", kv, f"Block {i} keys of the cached frames, after RoPE."),
                   _f32(f"past_value_{i}", kv, f"Block {i} values of the cached frames.")]
        outputs += [_f32(f"present_key_{i}", present), _f32(f"present_value_{i}", present)]
    b = d.dit_block_frames

    def case(new: int, past: int, offset: int, block: int = b, batch: int = 1) -> Case:
        return dit_call_case(new, past, offset, block, streams=batch)

    return GraphSpec(
        name=DIT, version=5, opset=OPSET, doc=flow_estimator_cached_spec.__doc__ or "",
        inputs=tuple(inputs), outputs=tuple(outputs),
        # TensorRT tunes its kernels for opt: nothing cached and ~10 s of frames (prompt included), the
        # shape of the offline flow, a stream's first chunk and its final re-run, which run most of the
        # DiT's frames; a later chunk is one hop of at most 200 frames over the cache. max: 60 s, as far
        # as the flow noise table reaches.
        dims={BATCH: DimRange(1, 1, MAX_BATCH), "new_frames": DimRange(1, 500, 3000),
              DIT_PAST_FRAMES: DimRange(0, 0, 3000)},
        derived={DIT_ROWS: DerivedDim({BATCH: 2}),
                 "total_frames": DerivedDim({"new_frames": 1, DIT_PAST_FRAMES: 1})},
        tolerances={o.name: Tolerance("max_abs", 1e-4) for o in outputs},
        trace=case(64, 100, 100),
        validate=(case(123, 0, 0),  # a first chunk: several blocks, no cache
                  case(37, 0, 0, 37),  # an offline call: no cache, full attention (b = new_frames)
                  case(37, 150, 150),  # a later chunk, in step with its cache
                  case(25, 75, 75, batch=2),  # two streams' later chunks stacked
                  case(20, 100, 600),  # a bounded window: cached frames dropped in between
                  case(45, 50, 50, 10_000)),  # full attention among the new frames, after a cache
        # integrated over 10 Euler steps: a 2e-2 relative error per evaluation of the velocity stays
        # inaudible; the caches are keys/values (fp16-rounded once stored)
        # int8: the keys and values come out of int8 projections, as the llm's caches do
        precision_tolerances={FP16.name: {o.name: Tolerance("rel_max_abs", 2e-2 if o.name == "velocity"
                                                            else 1e-2) for o in outputs},
                              INT8.name: {o.name: INT8_VELOCITY if o.name == "velocity" else INT8_CACHE
                                          for o in outputs},
                              BF16.name: {o.name: BF16_DIT for o in outputs}},
        solve_gates={INT8.name: SOLVE_GATES, BF16.name: BF16_SOLVE_GATES},
    )


def dit_attention(offset: int, new_frames: int, past_frames: int, block_frames: int) -> dict[str, np.ndarray]:
    """`flow_estimator_cached`'s `positions` (new_frames,) int64 and `attention_mask` (new_frames,
    past_frames + new_frames) bool for new frames at positions offset .. offset + new_frames - 1 after
    `past_frames` cached ones: every cached key visible (the runtime caches only frames that the block-causal
    mask shows to every later frame), and among the new frames position p sees position q iff
    q < (p // b + 1) * b, b = `block_frames` (b past the last position: full attention)."""
    if min(new_frames, block_frames) < 1 or min(offset, past_frames) < 0:
        raise ValueError(f"no DiT call of {new_frames} new frames at {offset} after {past_frames} cached, "
                         f"blocks of {block_frames}")
    positions = offset + np.arange(new_frames, dtype=np.int64)
    block_end = (positions // block_frames + 1) * block_frames
    new = positions[None, :] < block_end[:, None]  # (T, T)
    cached = np.ones((new_frames, past_frames), dtype=bool)
    return {"positions": positions, "attention_mask": np.concatenate([cached, new], axis=1)}


def dit_call_case(new_frames: int, past_frames: int, offset: int, block_frames: int, *, streams: int = 1
                  ) -> Case:
    """A `flow_estimator_cached` call of `streams` CFG pairs over `new_frames` frames at positions `offset`..
    after `past_frames` cached ones, attention blocks of `block_frames` among the new frames."""
    attention = dit_attention(offset, new_frames, past_frames, block_frames)
    return Case({BATCH: streams, "new_frames": new_frames, DIT_PAST_FRAMES: past_frames},
                {name: tuple(value.ravel().tolist()) for name, value in attention.items()})


def vocoder_case(frames: int, *, streams: int = 1) -> Case:
    """A `hift_decoder` call of `streams` rows over `frames` mel frames."""
    return Case({BATCH: streams, "frames": frames})


def hift_f0_spec(d: ModelDims) -> GraphSpec:
    """The F0 predictor (upstream computes it in float64; this graph is float32, its drift is measured,
    and it has no fp16 body).

    Mel frames beyond the input count as zeros (upstream's final call); a non-final call keeps only
    the first frames - 3, which see real look-ahead frames only."""
    return GraphSpec(
        name=HIFT_F0, version=1, opset=OPSET, doc=hift_f0_spec.__doc__ or "",
        inputs=(_f32("mel", (1, d.mel_bins, "frames"), "Log-mel frames.", -10.0, 2.0),),
        outputs=(_f32("f0", (1, "frames"), "Fundamental frequency in Hz (|classifier output|)."),),
        dims={"frames": DimRange(4, 500, 3000)},
        derived={},
        tolerances={"f0": Tolerance("max_abs", 1e-2)},
        trace=Case({"frames": 40}),
        validate=(Case({"frames": 17}), Case({"frames": 90})),
    )


def hift_decoder_spec(d: ModelDims) -> GraphSpec:
    """Mel + F0 -> waveform: the NSF source from `f0`, the explicit per-frame harmonic `phase` and the
    fixed noise table, then the source STFT, the upsampling decoder, iSTFT and the clamp.

    `phase` is upstream's staircase phase, which the caller must build bit for bit as upstream's float32
    arithmetic does (a float32 running sum drifts by radians within a minute): per frame t, harmonic k,
    U = samples_per_frame, fl32 = round to float32,
        rad[t,k] = fl32(fl32(f0[t] * k) / sample_rate) mod 1
        acc[t,k] = fl32(sum_{s<=t} rad[s,k]), summed in float64
        phase[t,k] = fl32(fmod(fl32(fl32(fl32(2 * acc) * fl32(pi)) * U), 2*pi)), fmod in float64.
    `sine_noise` is the table read from the utterance's first sample. Mel frames beyond the input count
    as zeros (final call); a non-final call keeps the first (frames - 8) * samples_per_frame samples.

    A call's `batch` rows are streams over the same frames of their utterances (the same first frame and
    frame count), so they share `sine_noise`; rows are independent, each stream's row its call alone to the
    rounding of the kernels (another batch, or threads splitting the rows otherwise: up to 3e-6 measured on
    a Zen 4 with AVX-512)."""
    h, spf = d.harmonics, d.samples_per_frame
    return GraphSpec(
        name=HIFT_DECODER, version=2, opset=OPSET, doc=hift_decoder_spec.__doc__ or "",
        inputs=(
            _f32("mel", (BATCH, d.mel_bins, "frames"), "Log-mel frames.", -10.0, 2.0),
            _f32("f0", (BATCH, "frames"), "F0 in Hz from hift_f0.", 0.0, 300.0),
            _f32("phase", (BATCH, "frames", h), "Harmonic phase per frame, mod 2*pi.", 0.0, 6.2831855),
            _f32("sine_noise", (1, "samples", h), "Uniform [0, 1) noise table, from the call's first sample "
                 "(the rows').", 0.0, 1.0),
        ),
        outputs=(_f32("waveform", (BATCH, "samples"), "Audio in [-audio_limit, audio_limit]."),),
        dims={BATCH: DimRange(1, 1, MAX_BATCH), "frames": DimRange(4, 500, 3000)},
        derived={"samples": DerivedDim({"frames": spf})},
        tolerances={"waveform": Tolerance("mean_abs", 2e-3)},
        trace=vocoder_case(24),
        validate=(vocoder_case(11), vocoder_case(57), vocoder_case(29, streams=3)),
        # the mean error relative to the mean amplitude (an L1, like the fp32 metric): -34 dB; bf16 measured
        # 7.0e-3 to 7.8e-3 (OpenVINO on AMX, full-size random, docs/export.md)
        precision_tolerances={p: {"waveform": Tolerance("rel_mean_abs", 2e-2)}
                              for p in (FP16.name, BF16.name)},
    )


SPECS: dict[str, Callable[[ModelDims], GraphSpec]] = {
    LLM: llm_spec,
    FLOW_ENCODER: flow_encoder_spec,
    DIT: flow_estimator_cached_spec,
    HIFT_F0: hift_f0_spec,
    HIFT_DECODER: hift_decoder_spec,
}
"""The graphs of every runtime bundle, in pipeline order."""
OPTIONAL_SPECS: dict[str, Callable[[ModelDims], GraphSpec]] = {
    LLM_PREFILL: llm_prefill_spec,
    LLM_DECODE: llm_decode_spec,
}
"""The graphs a bundle has only where its precision plan names them: second bodies of another graph's
function, faster for some of its calls."""


def spec(name: str, dims: ModelDims) -> GraphSpec:
    """The spec of graph `name` for a model of `dims`."""
    known = SPECS | OPTIONAL_SPECS
    if name not in known:
        raise KeyError(f"unknown graph {name!r}; known: {', '.join(known)}")
    return known[name](dims)


def metadata(s: GraphSpec, dims: ModelDims, extra: dict[str, Any] | None = None) -> dict[str, str]:
    """The `metadata_props` every exported graph carries: spec identity plus the model constants."""
    meta = {"spec_name": s.name, "spec_version": str(s.version), **dims.to_metadata()}
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    return meta
