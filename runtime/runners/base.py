"""The runner interface: `Runner`, the feed check against a graph's spec, and `RunnerBase`, which every
runner builds on."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, Self, TypeAlias, runtime_checkable

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import GraphSpec

from ..errors import FeedError
from .capture_gate import on_device

_ORT_DTYPES: dict[str, np.dtype[Any]] = {
    "tensor(float)": np.dtype(np.float32), "tensor(float16)": np.dtype(np.float16),
    "tensor(int64)": np.dtype(np.int64), "tensor(int32)": np.dtype(np.int32),
    "tensor(bool)": np.dtype(np.bool_)}


@dataclass(frozen=True)
class BufferView:  # a decode step binds ~50: what binding needs is computed once
    """Rows `first` to `first + count` of an onnxruntime tensor's first dim, on the tensor's device: a part
    of a buffer that a graph reads, or writes in place (`OrtRunner.infer_in_place`), bound by its address
    without a copy. onnxruntime's Python API has no view of part of a tensor and copies whole tensors only:
    this is how one decoding's row of a batch's caches on a GPU is a call's feed."""

    value: ort.OrtValue
    first: int
    count: int
    shape: tuple[int, ...] = field(init=False)
    dtype: np.dtype[Any] = field(init=False)
    device: str = field(init=False)
    """onnxruntime's name of the device ("cpu", "cuda")."""
    address: int = field(init=False)
    """Where row `first` starts (the rows are contiguous: a row holds the product of the other dims)."""

    def __post_init__(self) -> None:
        rows, *rest = self.value.shape()
        if not (0 <= self.first and 0 < self.count and self.first + self.count <= rows):
            raise ValueError(f"a view of {self.count} rows from row {self.first} of a tensor of {rows} rows")
        dtype = _ORT_DTYPES.get(self.value.data_type(), np.dtype(object))
        described = {"shape": (self.count, *rest), "dtype": dtype, "device": self.value.device_name().lower(),
                     "address": self.value.data_ptr() + self.first * math.prod(rest) * dtype.itemsize}
        for name, value in described.items():
            object.__setattr__(self, name, value)

    def numpy(self) -> np.ndarray:
        """The rows on the host (a copy of the whole tensor where it is on a device)."""
        with on_device(self.device):
            return self.value.numpy()[self.first:self.first + self.count]


Feed: TypeAlias = np.ndarray | ort.OrtValue | BufferView
"""A graph input: a numpy array, an onnxruntime value left on its device by `OrtRunner.infer_kept`, or rows
of one (`BufferView`)."""


def to_host(value: Feed) -> np.ndarray:
    """`value` as a numpy array: itself, or copied from its device (an `OrtValue` on the CPU: its memory)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, BufferView):
        return value.numpy()
    with on_device(value.device_name().lower()):
        return value.numpy()


@runtime_checkable
class Runner(Protocol):
    """Runs one graph of the bundle; use as a context manager or call `close`."""

    @property
    def spec(self) -> GraphSpec: ...

    def infer(self, feeds: Mapping[str, Feed]) -> dict[str, np.ndarray]:
        """Run the graph on `feeds` (every spec input, by name); returns every spec output, by name."""
        ...

    def infer_outputs(self, feeds: Mapping[str, Feed], names: Sequence[str]) -> dict[str, np.ndarray]:
        """`infer` returning only the outputs in `names`."""
        ...

    def infer_kept(self, feeds: Mapping[str, Feed], keep: Collection[str]
                   ) -> tuple[dict[str, np.ndarray], dict[str, Feed]]:
        """`infer` split in two: the outputs not in `keep` as numpy arrays, and those in `keep` as values
        that later calls take back as feeds, left on the device where the runner can."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None: ...


def _shape_dtype(value: object) -> tuple[tuple[int, ...], np.dtype[Any]] | None:
    """Shape and dtype of a feed (numpy, `OrtValue` or `BufferView`); None for anything else."""
    if isinstance(value, np.ndarray | BufferView):
        return value.shape, value.dtype
    if isinstance(value, ort.OrtValue):
        return tuple(value.shape()), _ORT_DTYPES.get(value.data_type(), np.dtype(object))
    return None


def feed_shape(value: Feed) -> tuple[int, ...]:
    """The shape of a feed, a numpy array or an `OrtValue` wherever it lives."""
    described = _shape_dtype(value)
    if described is None:
        raise TypeError(f"not a feed: {type(value).__name__}")
    return described[0]


def feed_nbytes(value: Feed) -> int:
    """The bytes a feed holds, on the host or on its device."""
    described = _shape_dtype(value)
    if described is None:
        raise TypeError(f"not a feed: {type(value).__name__}")
    shape, dtype = described
    return math.prod(shape) * dtype.itemsize


def check_feeds(spec: GraphSpec, feeds: Mapping[str, Feed]) -> None:
    """Raise `FeedError` unless `feeds` are exactly the spec's inputs with its dtypes, ranks and fixed
    dims, and every symbolic dim (free or derived) has one size across them."""
    inputs = spec.input_names  # a decode step checks ~50 feeds: each list is built once
    known = set(inputs)
    unknown = [name for name in feeds if name not in known]
    if unknown:
        raise FeedError(f"{spec.name}: unknown input {unknown[0]!r}; inputs are {', '.join(inputs)}")
    missing = [name for name in inputs if name not in feeds]
    if missing:
        raise FeedError(f"{spec.name}: missing input {missing[0]!r}")
    seen: dict[str, tuple[int, str]] = {}  # symbolic dim -> (size, the input that set it)
    for t in spec.inputs:
        where = f"{spec.name}.{t.name}"
        described = _shape_dtype(feeds[t.name])
        if described is None:
            raise FeedError(f"{where}: expected a numpy array, got {type(feeds[t.name]).__name__}")
        shape, dtype = described
        if dtype != t.np_dtype:
            raise FeedError(f"{where}: dtype {dtype}, expected {t.dtype}")
        if len(shape) != len(t.shape):
            raise FeedError(f"{where}: shape {shape} has rank {len(shape)}, expected {t.shape}")
        for axis, (want, got) in enumerate(zip(t.shape, shape, strict=True)):
            if isinstance(want, int):
                if got != want:
                    raise FeedError(f"{where}: shape {shape}, dim {axis} must be {want}; "
                                    f"expected {t.shape}")
            elif want in seen and seen[want][0] != got:
                raise FeedError(f"{where}: {want} = {got} (dim {axis}), but {seen[want][1]} has "
                                f"{want} = {seen[want][0]}")
            else:
                seen.setdefault(want, (got, t.name))
    free = {name: size for name, (size, _) in seen.items() if name in spec.dims}
    for name, derived in spec.derived.items():
        if name in seen and set(derived.terms) <= set(free) and seen[name][0] != derived.size(free):
            basis = ", ".join(f"{k} = {free[k]}" for k in derived.terms)
            raise FeedError(f"{spec.name}.{seen[name][1]}: {name} = {seen[name][0]}, expected "
                            f"{derived.size(free)} for {basis}")


class RunnerBase(ABC):
    """What every runner shares: the feed check, the closed state and the context manager. A subclass
    implements `_run` (outputs by name from checked host feeds) and `_release`."""

    def __init__(self, spec: GraphSpec) -> None:
        self._spec = spec
        self._closed = False

    @property
    def spec(self) -> GraphSpec:
        """The graph's spec: what `infer` takes and returns."""
        return self._spec

    @property
    def closed(self) -> bool:
        """Whether `close` was called: every call raises then."""
        return self._closed

    def infer(self, feeds: Mapping[str, Feed]) -> dict[str, np.ndarray]:
        """Run the graph on `feeds` (every spec input, by name); returns every spec output, by name.

        `OrtValue` feeds are copied to the host here. Raises `FeedError` naming the graph and tensor
        when a feed does not match the spec."""
        return self.infer_outputs(feeds, self._spec.output_names)

    def infer_outputs(self, feeds: Mapping[str, Feed], names: Sequence[str]) -> dict[str, np.ndarray]:
        """`infer` returning only the outputs in `names` (spec outputs, in any order): the others are
        not copied out (for a caller that drops a graph's caches)."""
        self._check_call(feeds, names)
        return self._run(_on_host(feeds), list(names))

    def infer_kept(self, feeds: Mapping[str, Feed], keep: Collection[str]
                   ) -> tuple[dict[str, np.ndarray], dict[str, Feed]]:
        """`infer` split in two: the outputs not in `keep`, and those in `keep`, which later calls take
        back as feeds (a cache). Here every output comes to the host, the kept ones as numpy arrays; a
        runner that can leave them on its device overrides this."""
        self._check_call(feeds, keep)
        outputs = self._run(_on_host(feeds), list(self._spec.output_names))
        return ({name: v for name, v in outputs.items() if name not in keep},
                {name: outputs[name] for name in keep})

    def _check_call(self, feeds: Mapping[str, Feed], names: Collection[str]) -> None:
        """Raise unless the runner is open, `names` are spec outputs and `feeds` match the spec."""
        if self._closed:
            raise RuntimeError(f"{self._spec.name}: runner is closed")
        outputs = set(self._spec.output_names)
        unknown = [name for name in names if name not in outputs]
        if unknown:
            raise ValueError(f"{self._spec.name}: unknown output {unknown[0]!r}; "
                             f"outputs are {', '.join(self._spec.output_names)}")
        check_feeds(self._spec, feeds)

    @abstractmethod
    def _run(self, feeds: Mapping[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        """The outputs `names` of the graph on checked host `feeds`."""

    def close(self) -> None:
        """Release the session or engine; `infer` refuses afterwards. Closing twice is harmless."""
        if not self._closed:
            self._closed = True
            self._release()

    @abstractmethod
    def _release(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _on_host(feeds: Mapping[str, Feed]) -> dict[str, np.ndarray]:
    """`feeds` as numpy arrays (`OrtValue`s and `BufferView`s copied to the host)."""
    return {k: to_host(v) for k, v in feeds.items()}
