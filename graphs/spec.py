"""The contract of an exported graph: ordered, named, typed I/O with symbolic dims and their profiles.

Plain data (numpy only). The exporter names a graph's inputs and outputs from its spec, the validator
checks the written graph against it and draws sample inputs from it, the TensorRT builder takes its
optimisation profiles from it, and the runtime binds tensors by its names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from .precision import EXACT_ON_CPU, FP32, PRECISIONS, REDUCED_PRECISIONS
from .providers import CUDA, TENSORRT

DTYPES: dict[str, type[np.generic]] = {
    "float32": np.float32,
    "float16": np.float16,
    "int64": np.int64,
    "int32": np.int32,
    "bool": np.bool_,
}

Shape = tuple[int | str, ...]
"""Each dim is a fixed size or the name of a symbolic dim of the graph."""
BATCH = "batch"
"""The symbolic dim of a graph's batch (`llm_decode`'s decodings per call); every other symbolic dim of a
cache is a length."""


@dataclass(frozen=True)
class DimRange:
    """A symbolic dim and its TensorRT profile (min <= opt <= max)."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.opt <= self.max:
            raise ValueError(f"profile needs 0 <= min <= opt <= max, got {self.min}/{self.opt}/{self.max}")


@dataclass(frozen=True)
class DerivedDim:
    """A symbolic dim fixed by free ones: size = sum(scale * free dim) + offset."""

    terms: Mapping[str, int]
    """Free dim name -> scale."""
    offset: int = 0

    def size(self, dims: Mapping[str, int]) -> int:
        return sum(scale * dims[name] for name, scale in self.terms.items()) + self.offset


@dataclass(frozen=True)
class TensorSpec:
    """One input or output."""

    name: str
    dtype: str
    shape: Shape
    doc: str = ""
    low: float = -1.0
    """Sample inputs are drawn uniformly from [low, high) (integers: [low, high))."""
    high: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"{self.name}: unknown dtype {self.dtype!r}")

    @property
    def np_dtype(self) -> type[np.generic]:
        return DTYPES[self.dtype]

    def symbols(self) -> list[str]:
        return [d for d in self.shape if isinstance(d, str)]


@dataclass(frozen=True)
class Tolerance:
    """How close an exported output must be to the torch reference."""

    metric: str
    """`max_abs`: max |a - b|; `mean_abs`: mean |a - b| (the L1 of the issue's audio metric);
    `rel_max_abs`: max |a - b| / max |b| and `rel_mean_abs`: mean |a - b| / mean |b|, relative to the
    reference's scale so that one figure fits any weights (used for fp16 bodies)."""
    bound: float

    def __post_init__(self) -> None:
        if self.metric not in ("max_abs", "mean_abs", "rel_max_abs", "rel_mean_abs"):
            raise ValueError(f"unknown metric {self.metric!r}")

    def measure(self, got: np.ndarray, want: np.ndarray) -> float:
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        if diff.size == 0:
            return 0.0
        scale = np.abs(want.astype(np.float64))
        tiny = float(np.finfo(np.float32).tiny)
        if self.metric == "max_abs":
            return float(diff.max())
        if self.metric == "mean_abs":
            return float(diff.mean())
        if self.metric == "rel_max_abs":
            return float(diff.max() / max(scale.max(), tiny))
        return float(diff.mean() / max(scale.mean(), tiny))


TF32_REL_MAX = Tolerance("rel_max_abs", 2e-3)
"""A float32 graph's outputs computed in TF32 on a GPU, against the CPU's float32: 7x the largest measured
(the demo bundle's `llm` log-probs, 2.8e-4 of their scale on an H200; `flow_encoder` 1.9e-4, the DiT
1.6e-4, `hift_f0` 5.7e-5)."""


@dataclass(frozen=True)
class Case:
    """A point to trace or validate at: sizes of the free symbolic dims, plus pinned input values."""

    dims: Mapping[str, int]
    values: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Inputs given explicitly (flattened, in the input's dtype) instead of drawn at random."""


@dataclass(frozen=True)
class DecodeGates:
    """Bounds on a reduced-precision autoregressive graph against the float32 reference, over one
    teacher-forced sequence: a prefill call, then `steps` one-position calls, each fed the float32
    reference's greedy id, so that both see the same history and every call's next-id distribution can
    be compared. Every bound is an upper bound on a figure of `measure`."""

    output: str
    """The log-probability output: one next-id distribution per call, (1, vocab)."""
    steps: int
    """Decode calls after the prefill; the gates cover their distributions and the prefill's."""
    mean_kl: float
    """Mean over calls of KL(p_fp32 || p_reduced), in nats."""
    top_k: int
    top_logp_error: float
    """Largest |log p_reduced - log p_fp32| over the float32 distribution's `top_k` most likely ids, at any
    call: the ids sampling actually chooses among."""
    greedy_mismatches: int
    """Calls whose most likely id differs from the float32 one."""

    def measure(self, got: np.ndarray, want: np.ndarray) -> dict[str, float]:
        """The gates' figures for log-probs `got` (reduced) and `want` (float32), (calls, vocab) each:
        `mean_kl`, `top_logp_error`, `greedy_mismatches`."""
        got64, want64 = got.astype(np.float64), want.astype(np.float64)
        kl = (np.exp(want64) * (want64 - got64)).sum(axis=-1)
        top = np.argsort(-want64, axis=-1)[:, :self.top_k]
        error = np.abs(np.take_along_axis(got64, top, -1) - np.take_along_axis(want64, top, -1))
        mismatches = int((got.argmax(axis=-1) != want.argmax(axis=-1)).sum())
        return {"mean_kl": float(kl.mean()), "top_logp_error": float(error.max()),
                "greedy_mismatches": float(mismatches)}

    def bounds(self) -> dict[str, float]:
        """The bound of each figure of `measure`, by the same names."""
        return {"mean_kl": self.mean_kl, "top_logp_error": self.top_logp_error,
                "greedy_mismatches": float(self.greedy_mismatches)}


@dataclass(frozen=True)
class SolveGates:
    """Bounds on a reduced-precision flow estimator against the float32 reference over whole ODE solves:
    the flow's Euler steps with classifier-free guidance, from the same noise and conditioning, each side
    integrating its own velocities, so that per-step errors are judged by what they do to the mel."""

    output: str
    """The velocity output the solver integrates."""
    frames: int
    """Mel frames of the solved utterance (prompt included)."""
    min_snr_db: float
    """Lowest mel SNR against the float32 mel, 10 log10(sum ref^2 / sum (got - ref)^2), in dB."""

    def measure(self, got: np.ndarray, want: np.ndarray) -> dict[str, float]:
        """The gate's figure for the mel `got` (reduced) against `want` (float32): `mel_rel_rms`,
        |got - want| / |want| over all values, which is the SNR as an upper bound: -20 log10 of it."""
        diff = float(np.linalg.norm(got.astype(np.float64) - want.astype(np.float64)))
        return {"mel_rel_rms": diff / max(float(np.linalg.norm(want.astype(np.float64))),
                                          float(np.finfo(np.float32).tiny))}

    def bounds(self) -> dict[str, float]:
        """The bound of each figure of `measure`, by the same names."""
        return {"mel_rel_rms": 10 ** (-self.min_snr_db / 20)}


@dataclass(frozen=True)
class GraphSpec:
    """Everything about one exported graph's interface."""

    name: str
    version: int
    """Bumped whenever the I/O or the semantics change; stored in the graph and the runtime manifest."""
    opset: int
    doc: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dims: Mapping[str, DimRange]
    """Free symbolic dims with their TensorRT profiles."""
    derived: Mapping[str, DerivedDim]
    """Symbolic dims that follow from a free one (outputs, and inputs tied to another input's length)."""
    tolerances: Mapping[str, Tolerance]
    """Per output name; every output has one."""
    trace: Case
    validate: tuple[Case, ...]
    """Validation points; each must differ from the trace point in at least one dim."""
    precision_tolerances: Mapping[str, Mapping[str, Tolerance]] = field(default_factory=dict)
    """Reduced precision (`REDUCED_PRECISIONS`) -> bounds per output for a body in it (float32 I/O)
    against the float32 torch reference. A graph without bounds for a precision stays float32 in a bundle
    of it."""
    decode_gates: Mapping[str, DecodeGates] = field(default_factory=dict)
    """Reduced precision -> sequence-level bounds that its body must also meet (autoregressive graphs)."""
    solve_gates: Mapping[str, SolveGates] = field(default_factory=dict)
    """Reduced precision -> ODE-level bounds that its body must also meet (flow estimators)."""
    precision_dtypes: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Reduced precision -> the I/O tensors a body in it has in another dtype than the spec's (name ->
    dtype): the caches an fp16 `llm_decode` writes in place, which a float32 interface would copy through a
    Cast at every call. `io_at` gives the spec of that body."""
    custom_opsets: Mapping[str, int] = field(default_factory=dict)
    """Operator domains besides ONNX's that the graph uses (domain -> version), which the exporter declares:
    onnxruntime's contrib operators (`llm_decode`'s `GroupQueryAttention`)."""

    def __post_init__(self) -> None:
        names = [t.name for t in (*self.inputs, *self.outputs)]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: duplicate tensor names")
        known = set(self.dims) | set(self.derived)
        for t in (*self.inputs, *self.outputs):
            unknown = set(t.symbols()) - known
            if unknown:
                raise ValueError(f"{self.name}.{t.name}: undeclared dims {sorted(unknown)}")
        for d in self.derived.values():
            if not set(d.terms) <= set(self.dims):
                raise ValueError(f"{self.name}: derived dim based on unknown free dims {sorted(d.terms)}")
        if set(self.tolerances) != {t.name for t in self.outputs}:
            raise ValueError(f"{self.name}: tolerances must cover exactly the outputs")
        for precision, tolerances in self.precision_tolerances.items():
            if precision not in REDUCED_PRECISIONS:
                raise ValueError(f"{self.name}: {precision!r} is not a reduced precision "
                                 f"{REDUCED_PRECISIONS}")
            if set(tolerances) != {t.name for t in self.outputs}:
                raise ValueError(f"{self.name}: {precision} tolerances must cover exactly the outputs")
        gated: list[tuple[str, DecodeGates | SolveGates]] = [*self.decode_gates.items(),
                                                             *self.solve_gates.items()]
        for precision, gates in gated:
            if precision not in self.precision_tolerances:
                raise ValueError(f"{self.name}: gates for {precision}, which has no tolerances")
            if gates.output not in {t.name for t in self.outputs}:
                raise ValueError(f"{self.name}: gates on unknown output {gates.output!r}")
        for precision, dtypes in self.precision_dtypes.items():
            if precision not in self.precision_tolerances:
                raise ValueError(f"{self.name}: I/O dtypes for {precision}, which has no tolerances")
            unknown = set(dtypes) - set(names)
            if unknown:
                raise ValueError(f"{self.name}: {precision} dtypes for unknown tensors {sorted(unknown)}")
            if any(d not in DTYPES for d in dtypes.values()):
                raise ValueError(f"{self.name}: {precision} dtypes must be among {sorted(DTYPES)}")
        for case in (self.trace, *self.validate):
            if set(case.dims) != set(self.dims):
                raise ValueError(f"{self.name}: a case must size every free dim {sorted(self.dims)}")
        if any(dict(c.dims) == dict(self.trace.dims) for c in self.validate):
            raise ValueError(f"{self.name}: validation must use shapes other than the trace shape")

    def precision_in(self, bundle_precision: str) -> str:
        """This graph's precision in a bundle exported in `bundle_precision`: that one where the spec
        bounds it or it is the float32 body computed otherwise (tf32), else fp32."""
        if bundle_precision in self.precision_tolerances or bundle_precision in EXACT_ON_CPU:
            return bundle_precision
        return FP32.name

    def tolerances_for(self, precision: str) -> Mapping[str, Tolerance]:
        """The bounds a body in `precision` is validated with: `tolerances` for the float32 body (fp32,
        tf32)."""
        if precision in EXACT_ON_CPU:
            return self.tolerances
        if precision not in self.precision_tolerances:
            raise ValueError(f"{self.name}: its spec has no {precision} tolerances, so it has no {precision} "
                             "body")
        return self.precision_tolerances[precision]

    def tolerances_on(self, precision: str, provider: str) -> Mapping[str, Tolerance]:
        """The bounds a body in `precision` is judged by on `provider`: `tolerances_for`, except where the
        CUDA provider computes a tf32 graph in TF32 (matmul inputs rounded to a 10-bit mantissa): there an
        output bounded by its largest error is bounded relative to its scale (`TF32_REL_MAX`), a mean bound
        stays."""
        bounds = self.tolerances_for(precision)
        if not (PRECISIONS[precision].cuda_tf32 and provider in (CUDA, TENSORRT)):
            return bounds
        return {name: TF32_REL_MAX if t.metric == "max_abs" else t for name, t in bounds.items()}

    def at_precision(self, precision: str) -> GraphSpec:
        """This spec with the bounds of a body in `precision` as its `tolerances`, and that body's I/O
        (`io_at`)."""
        return replace(self.io_at(precision), tolerances=self.tolerances_for(precision))

    def io_at(self, precision: str) -> GraphSpec:
        """This spec with the I/O dtypes of a body in `precision` (`precision_dtypes`; the spec's own for
        every other precision)."""
        dtypes = self.precision_dtypes.get(precision, {})
        if not dtypes:
            return self

        def typed(tensors: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
            return tuple(replace(t, dtype=dtypes.get(t.name, t.dtype)) for t in tensors)

        return replace(self, inputs=typed(self.inputs), outputs=typed(self.outputs))

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def sizes(self, dims: Mapping[str, int]) -> dict[str, int]:
        """Sizes of every symbolic dim (free and derived) for the free-dim sizes `dims`."""
        out = dict(dims)
        for name, d in self.derived.items():
            out[name] = d.size(dims)
        return out

    def shape_of(self, tensor: TensorSpec, dims: Mapping[str, int]) -> tuple[int, ...]:
        sizes = self.sizes(dims)
        return tuple(d if isinstance(d, int) else sizes[d] for d in tensor.shape)

    def nbytes_of(self, tensor: TensorSpec, dims: Mapping[str, int]) -> int:
        """The bytes of `tensor` at the free-dim sizes `dims`."""
        return math.prod(self.shape_of(tensor, dims)) * np.dtype(tensor.np_dtype).itemsize

    def sample_inputs(self, case: Case, seed: int = 0) -> dict[str, np.ndarray]:
        """Inputs for `case`: pinned values where given, else uniform draws in each input's range."""
        rng = np.random.default_rng(seed)
        feeds: dict[str, np.ndarray] = {}
        for t in self.inputs:
            shape = self.shape_of(t, case.dims)
            if t.name in case.values:
                feeds[t.name] = np.asarray(case.values[t.name], dtype=t.np_dtype).reshape(shape)
            elif np.issubdtype(t.np_dtype, np.integer):
                feeds[t.name] = rng.integers(int(t.low), int(t.high), size=shape).astype(t.np_dtype)
            elif t.np_dtype is np.bool_:
                feeds[t.name] = rng.random(shape) < 0.5
            else:
                feeds[t.name] = rng.uniform(t.low, t.high, size=shape).astype(t.np_dtype)
        return feeds

    def profile(self, tensor: TensorSpec) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(min, opt, max) shapes of an input for a TensorRT optimisation profile."""
        def at(which: str) -> tuple[int, ...]:
            return self.shape_of(tensor, {n: getattr(r, which) for n, r in self.dims.items()})

        return at("min"), at("opt"), at("max")


CACHE_IN_PREFIX = "past_"
CACHE_OUT_PREFIX = "present_"


def cache_pairs(spec: GraphSpec) -> list[tuple[str, str]]:
    """(input, output) names of every cache the graph carries: `past_X` is fed back from `present_X`."""
    outputs = set(spec.output_names)
    pairs = []
    for name in spec.input_names:
        if name.startswith(CACHE_IN_PREFIX):
            out = CACHE_OUT_PREFIX + name.removeprefix(CACHE_IN_PREFIX)
            if out not in outputs:
                raise ValueError(f"{spec.name}: cache input {name} has no output {out}")
            pairs.append((name, out))
    return pairs


def empty_caches(spec: GraphSpec) -> dict[str, np.ndarray]:
    """The `past_*` inputs of one row (one of `BATCH`, and what dims derive from it) before its first call:
    zero-length along their symbolic lengths (nothing cached yet), zeros where the cache has a fixed size
    (a causal conv's left padding)."""
    shapes = {t.name: t for t in spec.inputs}
    sizes = spec.sizes({name: 1 if name == BATCH else 0 for name in spec.dims})
    return {past: np.zeros(spec.shape_of(shapes[past], sizes), dtype=shapes[past].np_dtype)
            for past, _ in cache_pairs(spec)}
