"""The contract of an exported graph: ordered, named, typed I/O with symbolic dims and their profiles.

Plain data (numpy only). The exporter names a graph's inputs and outputs from its spec, the validator
checks the written graph against it and draws sample inputs from it, the TensorRT builder takes its
optimisation profiles from it, and the runtime binds tensors by its names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

DTYPES: dict[str, type[np.generic]] = {
    "float32": np.float32,
    "float16": np.float16,
    "int64": np.int64,
    "int32": np.int32,
    "bool": np.bool_,
}

Shape = tuple[int | str, ...]
"""Each dim is a fixed size or the name of a symbolic dim of the graph."""


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


@dataclass(frozen=True)
class Case:
    """A point to trace or validate at: sizes of the free symbolic dims, plus pinned input values."""

    dims: Mapping[str, int]
    values: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Inputs given explicitly (flattened, in the input's dtype) instead of drawn at random."""


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
    fp16_tolerances: Mapping[str, Tolerance] = field(default_factory=dict)
    """Bounds for a float16 body (float32 I/O) against the float32 torch reference, per output; empty
    means the graph stays float32 at every precision."""

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
        if self.fp16_tolerances and set(self.fp16_tolerances) != {t.name for t in self.outputs}:
            raise ValueError(f"{self.name}: fp16 tolerances must cover exactly the outputs")
        for case in (self.trace, *self.validate):
            if set(case.dims) != set(self.dims):
                raise ValueError(f"{self.name}: a case must size every free dim {sorted(self.dims)}")
        if any(dict(c.dims) == dict(self.trace.dims) for c in self.validate):
            raise ValueError(f"{self.name}: validation must use shapes other than the trace shape")

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
    """The `past_*` inputs before the first call: zero-length along their symbolic dims (nothing cached
    yet), zeros where the cache has a fixed size (a causal conv's left padding)."""
    shapes = {t.name: t for t in spec.inputs}
    return {past: np.zeros(tuple(0 if isinstance(d, str) else d for d in shapes[past].shape),
                           dtype=shapes[past].np_dtype)
            for past, _ in cache_pairs(spec)}
