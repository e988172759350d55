"""Judge a runtime run against its golden: tokens and chunk boundaries exactly, the audio against the
torch reference's within the backend's bounds, and, on the reference backend, every chunk's PCM16 hash
and every graph's output statistics bit for bit. A failure names the first chunk and sample where the
output diverged. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from cosyvoice_graphs import Tolerance
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.runners import Runner

from .cases import Bounds, Reference
from .run import CaseRun, chunk_record, cpu_signature
from .stats import largest_drift, stats_difference
from .store import CaseGolden, ChunkGolden, GraphGolden, export_difference

PASS, FAIL, UNJUDGED = "✓", "✗", "–"


@dataclass(frozen=True)
class Verdict:
    """The outcome of one case or graph: one line for the user."""

    name: str
    passed: bool
    summary: str
    """What was measured, against which bound."""
    problem: str = ""
    """The first thing that failed, and where; or why nothing was judged."""
    judged: bool = True
    """False where nothing could be compared (neither passed nor failed): a sampled draw another precision's
    rounding moved."""

    def line(self, width: int = 34) -> str:
        mark = UNJUDGED if not self.judged else PASS if self.passed else FAIL
        text = f"{mark} {self.name:<{width}} {self.summary}"
        return f"{text} — {self.problem}" if self.problem else text


def snr_db(got: np.ndarray, want: np.ndarray) -> float:
    """10 log10(sum want^2 / sum (got - want)^2), in float64; inf when they are equal."""
    diff = got.astype(np.float64) - want.astype(np.float64)
    noise, signal = float(np.square(diff).sum()), float(np.square(want.astype(np.float64)).sum())
    return math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-30) / noise)


@dataclass(frozen=True)
class Metrics:
    """Audio, and the mel the vocoder read, against the torch reference's."""

    max_abs: float
    l1: float
    snr_db: float
    mel_snr_db: float

    @classmethod
    def of(cls, got: np.ndarray, want: np.ndarray, got_mel: np.ndarray, want_mel: np.ndarray) -> Metrics:
        """Samples `got` against `want`, mels (1, 80, frames) `got_mel` against `want_mel`."""
        diff = got.astype(np.float64) - want.astype(np.float64)
        l1 = float(np.abs(diff).mean()) if diff.size else 0.0
        return cls(float(np.abs(diff).max(initial=0.0)), l1, snr_db(got, want), snr_db(got_mel, want_mel))

    def _judged(self, bounds: Bounds) -> list[tuple[bool, str, str]]:
        """Per bound given: whether it holds, the figure against it, and the figure as a violation."""
        out = []
        for label, value, bound in (("l1", self.l1, bounds.l1), ("max_abs", self.max_abs, bounds.max_abs)):
            if bound is not None:
                out.append((value <= bound, f"{label} {value:.2e} ≤ {bound:.0e}",
                            f"{label} {value:.2e} > {bound:.0e}"))
        for label, value, bound in (("snr", self.snr_db, bounds.snr_db),
                                    ("mel snr", self.mel_snr_db, bounds.mel_snr_db)):
            if bound is not None:
                out.append((value >= bound, f"{label} {value:.1f} ≥ {bound:g} dB",
                            f"{label} {value:.1f} < {bound:g} dB"))
        return out

    def violations(self, bounds: Bounds) -> list[str]:
        """Each bound that does not hold, in words."""
        return [violated for holds, _, violated in self._judged(bounds) if not holds]

    def describe(self, bounds: Bounds) -> str:
        return " · ".join(figure for _, figure, _ in self._judged(bounds))

    def to_json(self) -> dict[str, float]:
        return {"max_abs": self.max_abs, "l1": self.l1, "snr_db": self.snr_db, "mel_snr_db": self.mel_snr_db}


Layout = list[tuple[tuple[int, ...], list[tuple[tuple[int, int], tuple[int, int]]]]]
"""Per segment: its speech tokens, and per chunk its token and sample ranges."""


def structure_problem(want: Layout, run: CaseRun) -> str | None:
    """The first difference from `want` in segments, speech tokens or chunk boundaries (None if none)."""
    if len(run.segments) != len(want):
        return f"{len(run.segments)} segments, golden {len(want)}"
    for s, (seg, (tokens, chunks)) in enumerate(zip(run.segments, want, strict=True)):
        if tuple(seg.speech_tokens) != tokens:
            pairs = enumerate(zip(seg.speech_tokens, tokens, strict=False))
            i = next((i for i, (a, b) in pairs if a != b), None)
            if i is None:
                return (f"segment {s}: {len(seg.speech_tokens)} speech tokens, golden {len(tokens)} "
                        "(the shorter is a prefix of the longer)")
            return f"segment {s}: speech token {i} is {seg.speech_tokens[i]}, golden {tokens[i]}"
        if len(seg.chunks) != len(chunks):
            return f"segment {s}: {len(seg.chunks)} chunks, golden {len(chunks)}"
        for got, ranges in zip(seg.chunks, chunks, strict=True):
            if (got.token_range, got.sample_range) != ranges:
                return (f"segment {s} chunk {got.index}: tokens {list(got.token_range)}, samples "
                        f"{list(got.sample_range)}; golden {list(ranges[0])}, {list(ranges[1])}")
    return None


def tokens_differ(want: Layout, run: CaseRun) -> bool:
    """Whether `run`'s segments hold other speech tokens than `want`'s (counted alike)."""
    return len(run.segments) == len(want) and any(
        tuple(seg.speech_tokens) != tokens for seg, (tokens, _) in zip(run.segments, want, strict=True))


def _chunks(golden: CaseGolden) -> list[tuple[int, ChunkGolden, int]]:
    """(segment, chunk, offset of the chunk's first sample in the case's audio) for every chunk."""
    out, offset = [], 0
    for s, seg in enumerate(golden.segments):
        out += [(s, c, offset + c.sample_range[0]) for c in seg.chunks]
        offset += seg.samples
    return out


def divergence(golden: CaseGolden, got: np.ndarray, threshold: Callable[[ChunkGolden], float]) -> str | None:
    """The first sample, in chunk order, further from the torch audio than its chunk's threshold."""
    for s, chunk, start in _chunks(golden):
        end = start + chunk.sample_range[1] - chunk.sample_range[0]
        diff = np.abs(got[start:end].astype(np.float64) - golden.audio[start:end])
        over = np.flatnonzero(diff > threshold(chunk))
        if over.size:
            i = int(over[0])
            return (f"diverges at segment {s} chunk {chunk.index}, sample {chunk.sample_range[0] + i} "
                    f"(|Δ| {diff[i]:.2e} > {threshold(chunk):.2e})")
    return None


def _worst_chunk(golden: CaseGolden, got: np.ndarray) -> str:
    def l1(item: tuple[int, ChunkGolden, int]) -> float:
        _, chunk, start = item
        end = start + chunk.sample_range[1] - chunk.sample_range[0]
        return float(np.abs(got[start:end].astype(np.float64) - golden.audio[start:end]).mean())

    s, chunk, _ = max(_chunks(golden), key=l1)
    return f"largest mean |Δ| in segment {s} chunk {chunk.index}"


def not_exact(golden: CaseGolden, bundle: RuntimeBundle, provider: str, threads: int, reference: Reference
              ) -> str | None:
    """Why the bit-exact checks do not apply to a run on `provider` with `threads` over `bundle`, or None
    when they do: the reference backend, on the recorded export, with the recording's onnxruntime, on a
    CPU with the same kernel-relevant features (other CPUs may take other code paths)."""
    if provider != reference.provider:
        return f"not the reference provider {reference.provider}"
    if threads != reference.threads:
        return f"{threads} threads, the reference has {reference.threads}"
    export = export_difference(golden.bundle, bundle)
    if export is not None:
        return export
    recorded = golden.reference
    if recorded.get("onnxruntime") != ort.__version__:
        return f"recorded with onnxruntime {recorded.get('onnxruntime')}, this is {ort.__version__}"
    if recorded.get("cpu") != cpu_signature():
        return f"recorded on another CPU ({recorded.get('cpu')}; this is {cpu_signature()})"
    return None


def compare_case(golden: CaseGolden, run: CaseRun, provider: str, bounds: Bounds, inexact: str | None, *,
                 moved_draws: str | None = None) -> Verdict:
    """Judge `run` on `provider` against `golden`; `inexact` says why the bit-exact checks do not apply
    (None: they do; see `not_exact`). `moved_draws` names the precision whose rounding may move a sampled
    draw: where the speech tokens then differ, nothing is comparable and the case is not judged (its
    greedy cases judge that precision's tokens)."""
    timing = f"[{run.seconds:.2f} s]"
    problem = structure_problem(golden.layout(), run)
    if problem is not None and moved_draws is not None and tokens_differ(golden.layout(), run):
        return Verdict(golden.name, False, f"{provider}: not judged {timing}",
                       f"{problem}: a sampled draw that {moved_draws}'s rounding moved", judged=False)
    if problem is not None:
        return Verdict(golden.name, False, f"{provider}: tokens/boundaries {timing}", problem)
    if run.mel.shape != golden.mel.shape:
        return Verdict(golden.name, False, f"{provider}: mel {timing}",
                       f"{run.mel.shape[2]} generated mel frames, golden {golden.mel.shape[2]}")
    got = run.audio
    metrics = Metrics.of(got, golden.audio, run.mel, golden.mel)
    mode = f"{provider} · exact" if inexact is None else f"{provider} · tolerance ({inexact})"
    summary = f"{mode} · {metrics.describe(bounds)} {timing}"
    if inexact is None:
        records = [chunk_record(s, c) for s, seg in enumerate(run.segments) for c in seg.chunks]
        for record, (s, chunk, _) in zip(records, _chunks(golden), strict=True):
            if record["pcm16_sha256"] != chunk.pcm16_sha256:
                where = divergence(golden, got, lambda c: c.reference_max_abs) or (
                    f"segment {s} chunk {chunk.index}: every sample within the recorded distance from torch")
                return Verdict(golden.name, False, summary, f"PCM16 sha256 differs; {where}")
        stats = stats_difference(run.graph_stats, golden.graph_stats)
        if stats is not None:
            return Verdict(golden.name, False, summary, f"graph statistics differ: {stats}")
        summary = f"{provider} · exact: {len(records)} of {len(records)} chunk hashes · " \
                  f"{metrics.describe(bounds)} {timing}"
    violations = metrics.violations(bounds)
    if violations:
        max_abs = bounds.max_abs
        where = (divergence(golden, got, lambda c: max_abs) if max_abs is not None else None) or \
            f"{_worst_chunk(golden, got)}{'' if max_abs is None else ' (no sample past max_abs)'}"
        drift = largest_drift(run.graph_stats, golden.graph_stats)
        hint = f"; most drifted graph output: {drift[0]} ({drift[1]:.1e} of its rms)" if drift else ""
        return Verdict(golden.name, False, summary, f"{', '.join(violations)}; {where}{hint}")
    return Verdict(golden.name, True, summary)


def _cases(n: int) -> str:
    return f"{n} case{'s' * (n != 1)}"


def compare_graph(golden: GraphGolden, runner: Runner, tolerances: Mapping[str, Tolerance]) -> Verdict:
    """Run every stored case of a graph golden on `runner`; each output within its spec tolerance."""
    name = f"graph {golden.graph}"
    worst: tuple[float, str] | None = None
    for case in golden.cases:
        got = runner.infer(case.inputs)
        for output, want in case.outputs.items():
            tol = tolerances[output]
            value = got[output]
            where = f"output {output} at {case.label}"
            if value.shape != want.shape:
                return Verdict(name, False, _cases(len(golden.cases)), f"{where}: shape {value.shape}, "
                               f"golden {want.shape}")
            if not np.isfinite(value).all():
                return Verdict(name, False, _cases(len(golden.cases)), f"{where}: non-finite values")
            measured = tol.measure(value, want)
            ratio = measured / tol.bound if tol.bound > 0 else (0.0 if measured == 0 else math.inf)
            text = f"{output} {tol.metric} {measured:.2e} ≤ {tol.bound:.0e}"
            if measured > tol.bound:
                return Verdict(name, False, _cases(len(golden.cases)),
                               f"{where}: {tol.metric} {measured:.2e} > {tol.bound:.0e}")
            if worst is None or ratio > worst[0]:
                worst = (ratio, text)
    summary = f"{_cases(len(golden.cases))} · worst {worst[1] if worst else 'n/a'}"
    return Verdict(name, True, summary)
