"""How each graph is made and run beyond its I/O: one `GraphRecipe` per graph, plain data.

A graph's spec (`registry`) says what it computes; its recipe says what `--precision` calls it, how the
exporter makes each of its reduced-precision bodies, how onnxruntime runs it on the CPU, and which noise
table its profile bounds. The exporter's precision conversions, the precision plan, the runtime's
onnxruntime settings and the exporter's noise tables read it. The torch side of a graph (the wrapper that
exports it, the sequence its decode gates run) is the exporter's: `cosyvoice_export.onnx.graphs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .bundle_layout import FLOW_NOISE, SINE_NOISE
from .precision import INT4, INT8
from .registry import DIT, FLOW_ENCODER, HIFT_DECODER, HIFT_F0, LLM, LLM_DECODE, LLM_PREFILL

NBITS = "MatMulNBits"
"""Weights quantized per block for onnxruntime's `MatMulNBits`: for a graph that multiplies one row at a
time (`cosyvoice_export.onnx.quantize` says why)."""
DYNAMIC = "DynamicQuantizeMatMul"
"""onnxruntime's dynamic quantization: for a graph that multiplies hundreds of rows at once."""
ACCURACY_LEVEL = 4
"""`NBITS`: `MatMulNBits.accuracy_level`: 4 = int8 activations and integer compute (0/1 = float32
compute, far slower: docs/performance-log.md, "Which int8 operator: measured")."""


@dataclass(frozen=True)
class QuantScheme:
    """How one graph's weight matmuls are quantized."""

    operator: str
    """`NBITS` or `DYNAMIC`."""
    fp32_scopes: tuple[str, ...]
    """Regexes of node names (module scopes) whose matmuls stay float32."""
    bits: int = 8
    """`NBITS`: bits per weight (`DYNAMIC` is int8)."""
    block_size: int = 32
    """`NBITS`: input channels per weight scale (and per activation scale)."""
    symmetric: bool = True
    """`NBITS`: scales only (True), or scales and zero points."""

    @property
    def rows_share_scales(self) -> bool:
        """Whether a row's results depend on the other rows of its call: `DYNAMIC` quantizes the activations
        per tensor, one scale over every row; `NBITS` per block of each row."""
        return self.operator == DYNAMIC

    def describe(self) -> str:
        """The scheme as recorded in the graph's metadata."""
        if self.operator == NBITS:
            kind = "symmetric" if self.symmetric else "asymmetric"
            return (f"MatMulNBits bits={self.bits} block_size={self.block_size} {kind} "
                    f"accuracy_level={ACCURACY_LEVEL}")
        return "DynamicQuantizeMatMul weights=int8 per-channel reduce_range activations=uint8 per-tensor"


@dataclass(frozen=True)
class GraphRecipe:
    """One graph's facts beside its spec: its short names, its reduced-precision bodies, its onnxruntime
    session defaults and the noise tables it bounds."""

    name: str
    """The graph, a key of `SPECS` or `OPTIONAL_SPECS`."""
    aliases: tuple[str, ...] = ()
    """Its short names in `--precision graph=precision` (an alias may name several graphs: each takes the
    precision)."""
    fp16_fp32_scopes: tuple[str, ...] | None = None
    """Regexes of node names (module scopes) its fp16 body keeps float32; None: it has no fp16 body."""
    quantization: Mapping[str, QuantScheme] = field(default_factory=dict)
    """Precision (int8, int4) -> how its body in it quantizes the weight matmuls; the quantized bodies it
    has."""
    float32_optional: bool = False
    """An optional graph (`OPTIONAL_SPECS`) with a float32 body: a plan may name it in fp32."""
    ort_optimization: str = "all"
    """onnxruntime's graph optimisation level for it on the CPU without a tuning file (a key of
    `cosyvoice_runtime.runners.ort_settings.OPTIMIZATION`). `all` everywhere: no other level was clearly
    faster for any graph on the CPUs measured (docs/runtime.md, "Measured defaults")."""
    ort_keep_spinning: bool = False
    """Whether its onnxruntime intra-op workers keep spinning after a call, onnxruntime's default; every
    other graph's session stops them. A pipeline runs its sessions one after another on the same cores, and
    workers still spinning after one session's call take them from the next one's. The decode bodies
    (`llm`, `llm_decode`) are the exception: called back to back with a little sampling in between, they
    would pay for waking their workers every step (docs/runtime.md, "Measured defaults")."""
    ort_arena_shrink: bool = False
    """Whether its onnxruntime session on the CPU gives back, after every call, what the call grew the
    session's memory arena by (onnxruntime's arena shrinkage). For the graphs whose working memory follows the
    request's frames: an arena never shrinks on its own, so one long prompt's or text's calls would stay
    resident for the life of the process (1.6 GB after one full-size request with a 12 s prompt, on an AMD
    EPYC Zen 4). A streamed request pays nothing measurable for it there, an offline one 2-3 %
    (docs/performance.md, "Memory across requests")."""
    float32_cuda_form: bool = False
    """Whether its export written for onnxruntime alone (`Precision.onnxruntime_only`) uses only operators
    that onnxruntime's CUDA provider computes in float32: the DiT's `MultiHeadAttention` and `RotaryEmbedding`
    do, the llm's `GroupQueryAttention` computes float16 and bfloat16 only there. A float32 precision that
    runs on onnxruntime alone (tf32) takes that form for such a graph: on a GPU at one stream a call's time
    is its kernels' launches, and the DiT written so has 45 nodes a block against 107."""
    noise_tables: Mapping[str, str] = field(default_factory=dict)
    """Noise table (`bundle_layout`) -> its symbolic dim whose largest profile size is the longest the
    runtime can read of the table."""


ROOT_SCOPE = r"^[^/]*/[^/]*$|^[^/]*$"
"""Nodes outside every submodule: the wrapper's own glue (masks, normalisations, HiFT's source, STFT and
iSTFT), kept float32 in every fp16 body."""
_LLM_FP32 = (r"/llm_decoder/",)
"""llm_decoder: 2% of the full-size weights, and its output is the log-probs themselves."""
_DIT_FP32 = (r"/input_embed/", r"/proj_out/")
"""The DiT's input/output projections (80 channels wide: little to gain at the ends)."""
_LLM_FP16_FP32 = (ROOT_SCOPE, r"layernorm/", r"/norm/", r"/llm_decoder/")
_LLM_INT8 = QuantScheme(NBITS, _LLM_FP32, bits=8, block_size=32)
_LLM_INT4 = QuantScheme(NBITS, _LLM_FP32, bits=4, block_size=32)
"""Block 32, symmetric: of 32/64/128 (symmetric or with zero points) the closest to fp32 by the decode gates
at about the same decode time (docs/performance-log.md, int4 LLM)."""

RECIPES: dict[str, GraphRecipe] = {r.name: r for r in (
    # RMSNorm (decomposed into Pow/ReduceMean/Sqrt/Div/Mul) and the output projection stay float32 in fp16
    GraphRecipe(LLM, fp16_fp32_scopes=_LLM_FP16_FP32,
                quantization={INT8.name: _LLM_INT8, INT4.name: _LLM_INT4}, ort_keep_spinning=True),
    # only the x-vector normalisation (in ROOT_SCOPE) is fragile
    GraphRecipe(FLOW_ENCODER, aliases=("encoder",), fp16_fp32_scopes=(ROOT_SCOPE,)),
    # fp16: AdaLN norms and the modulation table (ROOT_SCOPE), the output projection, RoPE tables; the
    # caches' concatenations are data movement
    GraphRecipe(DIT, aliases=("dit",),
                fp16_fp32_scopes=(ROOT_SCOPE, r"norm", r"/proj_out/", r"/rotary_embed/"),
                quantization={INT8.name: QuantScheme(DYNAMIC, _DIT_FP32)}, float32_cuda_form=True,
                noise_tables={FLOW_NOISE: "new_frames"}, ort_arena_shrink=True),
    # no fp16 body: upstream runs the F0 predictor in float64, so it stays float32 entirely
    GraphRecipe(HIFT_F0, aliases=("hift",), ort_arena_shrink=True),
    # fp16: Snake activations, the source merge (F0 path), the output conv; the source/STFT/iSTFT are
    # ROOT_SCOPE
    GraphRecipe(HIFT_DECODER, aliases=("hift",),
                fp16_fp32_scopes=(ROOT_SCOPE, r"/activations", r"/l_linear/", r"/conv_post/"),
                noise_tables={SINE_NOISE: "samples"}, ort_arena_shrink=True),
    # no float32 body: it exists only to be faster than `llm` (int8)
    GraphRecipe(LLM_PREFILL, aliases=("prefill",), quantization={INT8.name: QuantScheme(DYNAMIC, _LLM_FP32)}),
    # a float32 body: it batches decodings, which `llm` cannot, so `decode=fp32` batches them exactly
    GraphRecipe(LLM_DECODE, aliases=("decode",), fp16_fp32_scopes=_LLM_FP16_FP32,
                quantization={INT8.name: _LLM_INT8, INT4.name: _LLM_INT4}, float32_optional=True,
                ort_keep_spinning=True),
)}
"""Every graph's recipe, in pipeline order (`SPECS`, then `OPTIONAL_SPECS`)."""

NOISE_TABLES: dict[str, tuple[str, str]] = {table: (r.name, dim) for r in RECIPES.values()
                                             for table, dim in r.noise_tables.items()}
"""Noise table -> (graph, symbolic dim) whose largest profile size is the longest the runtime can read."""
