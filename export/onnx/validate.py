"""Numerical validation of an exported graph against its torch wrapper, with the spec's tolerances.

Every validation case of the spec (none of them the trace point) feeds the same `spec.sample_inputs`
to onnxruntime and to the wrapper; every output is compared with `spec.tolerances[name]`, and any
non-finite value fails the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from cosyvoice_graphs import Case, DecodeGates, GraphSpec, Precision, SolveGates
from cosyvoice_graphs.precision import FP32
from cosyvoice_graphs.providers import OPENVINO
from cosyvoice_runtime.runners import OpenVinoRunner

from .errors import ExportError
from .trace import torch_inputs

CPU = "CPUExecutionProvider"


def case_label(case: Case) -> str:
    """`new_len=7, past_len=0`, plus the inputs the case pins."""
    label = ", ".join(f"{k}={v}" for k, v in case.dims.items())
    if case.values:
        label += f" ({', '.join(case.values)} pinned)"
    return label


@dataclass(frozen=True)
class Figure:
    """One output at one case: how far the graph under test is from the reference."""

    case: str
    output: str
    metric: str
    measured: float
    """inf where the comparison could not be made (non-finite values, wrong shape)."""
    bound: float
    problem: str = ""
    """Why the output fails besides its error, e.g. non-finite values."""

    @property
    def passed(self) -> bool:
        return not self.problem and self.measured <= self.bound

    @property
    def ratio(self) -> float:
        """measured / bound: how much of its tolerance the output uses (inf when it has a problem)."""
        if self.problem:
            return float("inf")
        return self.measured / self.bound if self.bound > 0 else (0.0 if self.measured == 0 else float("inf"))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Figure:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def gate_figures(label: str, gates: DecodeGates | SolveGates, got: np.ndarray, want: np.ndarray,
                 what: str) -> tuple[Figure, ...]:
    """One figure per gate of `gates` for `got` (reduced precision) against `want` (float32) at `label`;
    non-finite values in `got` (`what` names them) fail every gate."""
    bad = int(got.size - np.isfinite(got).sum())
    problem = f"{bad} non-finite {what}" if bad else ""
    measured = {} if bad else gates.measure(got, want)
    return tuple(Figure(label, gates.output, metric, measured.get(metric, float("inf")), bound, problem)
                 for metric, bound in gates.bounds().items())


class ValidationError(ExportError):
    """An output of a graph is outside its tolerance (or non-finite) at a validation case."""

    def __init__(self, graph: str, figure: Figure, against: str = "torch") -> None:
        f = figure
        what = f.problem or f"{f.metric} error {f.measured:.3g} > bound {f.bound:.3g}"
        super().__init__(f"{graph}: output {f.output} at {f.case}: {what} (vs {against})")
        self.graph = graph
        self.case = f.case
        self.output = f.output
        self.measured = f.measured
        self.bound = f.bound
        self.figure = figure


@dataclass(frozen=True)
class GraphValidation:
    """Every figure of one graph, measured against one reference (`torch`, or ORT for TensorRT)."""

    graph: str
    provider: str
    against: str
    figures: tuple[Figure, ...]
    """Per validation case and output, with the output's tolerance."""
    gates: tuple[Figure, ...] = ()
    """Sequence-level figures of a reduced-precision body, one per gate (`decode_gates.validate_decode`);
    the metric names the gate."""

    @property
    def passed(self) -> bool:
        return all(f.passed for f in (*self.figures, *self.gates))

    @property
    def failures(self) -> list[ValidationError]:
        return [ValidationError(self.graph, f, self.against) for f in (*self.figures, *self.gates)
                if not f.passed]

    def worst(self) -> dict[str, Figure]:
        """Per output, the figure closest to (or furthest past) its bound."""
        out: dict[str, Figure] = {}
        for f in self.figures:
            if f.output not in out or f.ratio > out[f.output].ratio:
                out[f.output] = f
        return out

    def raise_for_failure(self) -> None:
        """Raise the first failure as a `ValidationError`."""
        failures = self.failures
        if failures:
            raise failures[0]


def compare_outputs(spec: GraphSpec, case: Case, got: Mapping[str, np.ndarray],
                    want: Mapping[str, np.ndarray]) -> list[Figure]:
    """Figures for every output of `spec`: `got` (graph under test) against `want` (reference)."""
    label = case_label(case)
    figures = []
    for t in spec.outputs:
        tol = spec.tolerances[t.name]
        g, w = np.asarray(got[t.name]), np.asarray(want[t.name])
        expected = spec.shape_of(t, case.dims)
        problem = ""
        if g.shape != expected or w.shape != expected:
            problem = f"shape {g.shape} (reference {w.shape}), spec says {expected}"
        elif not np.isfinite(g).all():
            problem = f"{int(np.size(g) - np.isfinite(g).sum())} non-finite values"
        elif not np.isfinite(w).all():
            problem = "non-finite values in the reference"
        measured = float("inf") if problem else tol.measure(g, w)
        figures.append(Figure(label, t.name, tol.metric, measured, tol.bound, problem))
    return figures


def ort_session(path: Path, provider: str = CPU) -> ort.InferenceSession:
    """An onnxruntime session on exactly `provider`; raises if onnxruntime would fall back to another."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # spinning ORT threads would starve the torch reference that runs between the ORT calls
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), options, providers=[provider])
    used = session.get_providers()
    if not used or used[0] != provider:
        raise ExportError(f"{path}: asked onnxruntime for {provider}, the session uses {', '.join(used)}")
    return session


def run_ort(session: ort.InferenceSession, spec: GraphSpec, feeds: Mapping[str, np.ndarray]
            ) -> dict[str, np.ndarray]:
    """Run `session` on `feeds`; the outputs by the spec's names."""
    outputs = session.run(spec.output_names, {n: feeds[n] for n in spec.input_names})
    return dict(zip(spec.output_names, outputs, strict=True))


GraphCall: TypeAlias = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]
"""A graph as a function: its feeds by name -> its outputs by the spec's names."""


def cpu_graph(path: Path, spec: GraphSpec, precision: str) -> tuple[GraphCall, str]:
    """The graph at `path` run as the runtime runs a graph of `precision` under `cpu`
    (`Precision.cpu_provider`: onnxruntime, or OpenVINO at the precision's hint), and the name of what runs
    it."""
    if Precision.named(precision).cpu_provider == OPENVINO:
        runner = OpenVinoRunner(path, spec, precision)
        return runner.infer, f"OpenVINO CPU {precision}"
    session = ort_session(path)
    return partial(run_ort, session, spec), CPU


def run_torch(wrapper: nn.Module, spec: GraphSpec, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the torch wrapper on `feeds`; the outputs by the spec's names."""
    with torch.no_grad():
        result = wrapper.eval()(*torch_inputs(spec, feeds))
    outputs = (result,) if isinstance(result, torch.Tensor) else tuple(result)
    if len(outputs) != len(spec.outputs):
        raise ExportError(f"{spec.name}: the wrapper returned {len(outputs)} outputs, spec has "
                          f"{len(spec.outputs)}")
    return {name: t.detach().cpu().numpy() for name, t in zip(spec.output_names, outputs, strict=True)}


def validation_cases(spec: GraphSpec, extra_cases: Iterable[Case] = ()) -> list[Case]:
    """The spec's validation cases, then `extra_cases`."""
    return [*spec.validate, *extra_cases]


@dataclass(frozen=True)
class TorchReference:
    """The torch wrapper's outputs at every validation case of a spec (fed `spec.sample_inputs(case)`): the
    torch half of `validate_graph`, which needs no graph, so that the wrapper's networks can be freed
    before the graph is made."""

    spec: GraphSpec
    outputs: tuple[tuple[Case, dict[str, np.ndarray]], ...]


def torch_reference(wrapper: nn.Module, spec: GraphSpec, *, extra_cases: Sequence[Case] = ()
                    ) -> TorchReference:
    """`wrapper`'s outputs at each of `validation_cases(spec, extra_cases)`."""
    cases = validation_cases(spec, extra_cases)
    if not cases:
        raise ExportError(f"{spec.name}: no validation cases; the spec must give shapes to validate at")
    return TorchReference(spec, tuple((case, run_torch(wrapper, spec, spec.sample_inputs(case)))
                                      for case in cases))


def validate_against(path: Path, reference: TorchReference, *, precision: str = FP32.name) -> GraphValidation:
    """Compare the ONNX graph at `path` (a `precision` graph, run as `cpu_graph` runs it) with the torch
    `reference` at each of its cases, with the reference spec's tolerances. Tolerance failures are returned
    as figures, not raised: see `GraphValidation.raise_for_failure`."""
    spec = reference.spec
    run, provider = cpu_graph(path, spec, precision)
    figures: list[Figure] = []
    for case, want in reference.outputs:
        figures += compare_outputs(spec, case, run(spec.sample_inputs(case)), want)
    return GraphValidation(spec.name, provider, "torch", tuple(figures))


def validate_graph(path: Path, wrapper: nn.Module, spec: GraphSpec, *, extra_cases: Sequence[Case] = (),
                   precision: str = FP32.name) -> GraphValidation:
    """Compare the ONNX graph at `path` (a `precision` graph, run as `cpu_graph` runs it) with `wrapper`
    at every validation case (`torch_reference`, then `validate_against`)."""
    reference = torch_reference(wrapper, spec, extra_cases=extra_cases)
    return validate_against(path, reference, precision=precision)
