"""What `cosyvoice-export all` did: the graphs, their validation, and the summary table it prints."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cosyvoice_graphs import PRECISIONS
from cosyvoice_graphs.manifest import FileEntry
from cosyvoice_graphs.pipeline import providers_run

from .graph_export import GraphResult
from .validate import Figure, ValidationError


@dataclass(frozen=True)
class Report:
    """What `export_all` did."""

    out: Path
    graphs: tuple[GraphResult, ...]
    manifest: Path | None
    """None when a graph failed validation: a bundle with a failing graph gets no manifest."""
    seconds: float
    files: dict[str, FileEntry]
    """Every file of the bundle (the manifest's `files`)."""

    @property
    def failures(self) -> list[ValidationError]:
        return [e for g in self.graphs for v in g.validations() for e in v.failures]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def providers(self) -> list[str]:
        """The providers the bundle runs on (`cosyvoice_graphs.pipeline.providers_run`)."""
        return providers_run({g.name: PRECISIONS[g.precision] for g in self.graphs},
                             [g.name for g in self.graphs if g.trt])

    def table(self) -> str:
        """The summary table: one row per graph (and per gate set and TensorRT plan), its worst
        output or gate."""
        rows = [("graph", "size", "output", "error", "tolerance", "run", "ok")]

        def row(label: str, figures: Iterable[Figure], size: str, run: str) -> None:
            f = max(figures, key=lambda fig: fig.ratio)
            error = f.problem[:24] if f.problem else f"{f.measured:.2e}"
            rows.append((label, size, f.output, error, f"{f.metric} <= {f.bound:.3g}", run,
                         "✓" if f.passed else "✗"))

        for g in self.graphs:
            run = "reused" if g.reused else "exported"
            row(g.name, g.validation.worst().values(), _human(g.size), run)
            if g.validation.gates:  # the gate closest to (or furthest past) its bound
                kind = "decode" if g.precision in g.spec.decode_gates else "solve"
                row(f"{g.name} [{g.precision} {kind}]", g.validation.gates, "", run)
            if g.trt_validation is not None:
                row(f"{g.name} [trt]", g.trt_validation.worst().values(), _human(_plan_size(g)), _plan_run(g))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        status = f"manifest: {self.manifest}" if self.manifest else "no manifest written: validation failed"
        runs = f"for {', '.join(self.providers)}"
        return "\n".join([*lines, f"{len(self.graphs)} graphs in {self.seconds:.1f} s, {runs}; {status}"])


def _plan_size(g: GraphResult) -> int:
    return g.trt.size if g.trt else 0


def _plan_run(g: GraphResult) -> str:
    return "cached" if g.trt and g.trt.cached else "built"


def _human(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
