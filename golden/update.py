"""`cosyvoice-golden update`: record expectations from the torch reference, checked against the runtime.

A case's speech tokens, chunk boundaries and audio come from the torch reference pipeline; the runtime on
the reference backend must reproduce the tokens and boundaries exactly and the audio within the case's
bound before anything is written, and then gives the PCM16 hashes and graph statistics that later checks
hold it to bit for bit. A golden is rewritten only when something in it changed; `changes` says what.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from cosyvoice_export.reference.pipeline import ReferencePipeline
from cosyvoice_runtime.bundle import RuntimeBundle

from .cases import Cases, GoldenCase
from .compare import Layout, Metrics, Verdict, structure_problem
from .errors import GoldenError
from .reference import ReferenceSegment, graph_golden, reference_segments
from .run import Runtime, chunk_record, cpu_signature
from .store import (
    CaseGolden,
    ChunkGolden,
    GraphGolden,
    SegmentGolden,
    fingerprint,
    read_case,
    read_graph,
    write_case,
    write_graph,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Recorded:
    """The outcome of recording one case or graph."""

    verdict: Verdict
    written: bool


def record_case(cases: Cases, runtime: Runtime, pipe: ReferencePipeline, case: GoldenCase) -> Recorded:
    """Record `case` from the torch reference into its golden files, unless the runtime (on the reference
    backend, which `runtime` must be) disagrees with it or nothing changed."""
    prompt, pieces = runtime.prompt(case), runtime.segments(case)
    try:
        reference = reference_segments(pipe, case, pieces, prompt.wav, prompt.text)
    except GoldenError:
        raise
    except ValueError as e:  # the torch reference refuses as upstream does (`should not get token`)
        raise GoldenError(f"case {case.name}: the torch reference failed: {e}") from None
    run = runtime.run(case)
    problem = structure_problem(_layout(reference), run)
    if problem is not None:
        return Recorded(Verdict(case.name, False, "not written: the runtime disagrees with torch", problem),
                        False)
    want = np.concatenate([audio for ref in reference for _, audio in ref.chunks]).astype(np.float32)
    want_mel = np.concatenate([ref.mel for ref in reference], axis=2).astype(np.float32)
    if run.mel.shape != want_mel.shape:
        return Recorded(Verdict(case.name, False, "not written: the runtime disagrees with torch",
                                f"{run.mel.shape[2]} generated mel frames, torch {want_mel.shape[2]}"), False)
    metrics = Metrics.of(run.audio, want, run.mel, want_mel)
    bounds = case.tolerance[runtime.provider_of(case)]
    violations = metrics.violations(bounds)
    if violations:
        return Recorded(Verdict(case.name, False, "not written: the runtime is too far from torch",
                                ", ".join(violations)), False)
    segments = []
    for s, (piece, ref, seg) in enumerate(zip(pieces, reference, run.segments, strict=True)):
        chunks = []
        for (token_range, audio), chunk in zip(ref.chunks, seg.chunks, strict=True):
            record = chunk_record(s, chunk)
            distance = float(np.abs(chunk.samples.astype(np.float64) - audio).max(initial=0.0))
            chunks.append(ChunkGolden(chunk.index, chunk.is_final, token_range, chunk.sample_range,
                                      record["sha256"], record["pcm16_sha256"], distance))
        segments.append(SegmentGolden(piece.text, tuple(ref.speech_tokens), tuple(chunks), ref.mel.shape[2]))
    versions = {lib: importlib.metadata.version(lib) for lib in ("onnxruntime", "torch", "numpy")}
    versions["cpu"] = cpu_signature()
    golden = CaseGolden(
        name=case.name, case=case.to_json(), bundle=fingerprint(runtime.bundle(case)),
        prompt={"wav_sha256": prompt.wav_sha256, "text": prompt.text},
        reference={"provider": runtime.provider_of(case), "threads": runtime.threads, **versions},
        segments=tuple(segments), graph_stats=run.graph_stats, metrics=metrics.to_json(), audio=want,
        mel=want_mel)
    change = case_changes(_existing(lambda: read_case(cases.data_dir, case.name)), golden)
    if change != "unchanged":
        write_case(cases.data_dir, golden)
    return Recorded(Verdict(case.name, True, f"{metrics.describe(bounds)} · {change}"), change != "unchanged")


def _layout(reference: list[ReferenceSegment]) -> Layout:
    """The torch reference's segments as `structure_problem` compares them."""
    out: Layout = []
    for ref in reference:
        chunks, start = [], 0
        for token_range, audio in ref.chunks:
            chunks.append((token_range, (start, start + len(audio))))
            start += len(audio)
        out.append((tuple(ref.speech_tokens), chunks))
    return out


def record_graph(cases: Cases, bundle: RuntimeBundle, pipe: ReferencePipeline, graph: str) -> Recorded:
    """Record graph `graph`'s golden bundle from the torch wrapper (`bundle` gives its spec and
    fingerprint)."""
    golden = graph_golden(pipe, bundle, graph, cases.graphs[graph])
    change = graph_changes(_existing(lambda: read_graph(cases.data_dir, graph)), golden)
    if change != "unchanged":
        write_graph(cases.data_dir, golden)
    indices = [c.index for c in golden.cases]
    return Recorded(Verdict(f"graph {graph}", True, f"validation cases {indices} · {change}"),
                    change != "unchanged")


def _existing(read: Callable[[], T]) -> T | None:
    """The golden on disk, or None when there is none or it cannot be read (it is replaced then)."""
    try:
        return read()
    except GoldenError:
        return None


# --- what changed -------------------------------------------------------------------------------------------

def case_changes(old: CaseGolden | None, new: CaseGolden) -> str:
    """What differs between a case's golden on disk and a new recording, in a few words."""
    if old is None:
        return "new"
    parts = []
    fields = sorted(k for k in set(old.case) | set(new.case) if old.case.get(k) != new.case.get(k))
    if fields:
        parts.append(f"case fields {', '.join(fields)}")
    for key in ("sources", "files"):
        if old.bundle.get(key) != new.bundle.get(key):
            parts.append("model" if key == "sources" else "bundle export")
    old_tokens = [t for s in old.segments for t in s.speech_tokens]
    new_tokens = [t for s in new.segments for t in s.speech_tokens]
    if len(old.segments) != len(new.segments):
        parts.append(f"segments {len(old.segments)} → {len(new.segments)}")
    if old_tokens != new_tokens:
        same = sum(a == b for a, b in zip(old_tokens, new_tokens, strict=False))
        parts.append(f"speech tokens {len(old_tokens)} → {len(new_tokens)} ({same} unchanged)")
    if old.samples != new.samples:
        parts.append(f"samples {old.samples} → {new.samples}")
    old_chunks = [c for s in old.segments for c in s.chunks]
    new_chunks = [c for s in new.segments for c in s.chunks]
    if [(c.token_range, c.sample_range) for c in old_chunks] != [(c.token_range, c.sample_range)
                                                                 for c in new_chunks]:
        parts.append(f"chunk boundaries ({len(old_chunks)} → {len(new_chunks)} chunks)")
    hashes = sum(a.pcm16_sha256 != b.pcm16_sha256 for a, b in zip(old_chunks, new_chunks, strict=False))
    if hashes or len(old_chunks) != len(new_chunks):
        parts.append(f"PCM16 hashes ({hashes + abs(len(old_chunks) - len(new_chunks))} of {len(new_chunks)})")
    if old.audio.shape == new.audio.shape and not np.array_equal(old.audio, new.audio):
        parts.append(f"torch audio (max |Δ| {np.abs(old.audio - new.audio).max():.1e})")
    if old.mel.shape != new.mel.shape or not np.array_equal(old.mel, new.mel):
        moved = f"max |Δ| {np.abs(old.mel - new.mel).max():.1e}" if old.mel.shape == new.mel.shape else \
            f"{old.mel.shape[2]} → {new.mel.shape[2]} frames"
        parts.append(f"torch mel ({moved})")
    if old.graph_stats != new.graph_stats:
        parts.append("graph statistics")
    if old.metrics != new.metrics:
        parts.append(f"l1 vs torch {old.metrics.get('l1', float('nan')):.6g} → {new.metrics['l1']:.6g}")
    return "changed: " + "; ".join(parts) if parts else "unchanged"


def graph_changes(old: GraphGolden | None, new: GraphGolden) -> str:
    """What differs between a graph's golden bundle on disk and a new recording."""
    if old is None:
        return "new"
    parts = []
    if old.spec_version != new.spec_version:
        parts.append(f"spec version {old.spec_version} → {new.spec_version}")
    if any(old.bundle.get(key) != new.bundle.get(key) for key in ("sources", "model")):
        parts.append("model")
    if [c.index for c in old.cases] != [c.index for c in new.cases]:
        parts.append(f"cases {[c.index for c in old.cases]} → {[c.index for c in new.cases]}")
    else:
        for kind in ("inputs", "outputs"):
            changed, delta = [], 0.0
            for o, n in zip(old.cases, new.cases, strict=True):
                a, b = getattr(o, kind), getattr(n, kind)
                for name in b:
                    if name not in a or a[name].shape != b[name].shape:
                        changed.append(f"{name} (shape)")
                    elif not np.array_equal(a[name], b[name]):
                        changed.append(name)
                        delta = max(delta, float(np.abs(a[name].astype(np.float64) - b[name]).max()))
            if changed:
                parts.append(f"{kind} {', '.join(dict.fromkeys(changed))} (max |Δ| {delta:.1e})")
    return "changed: " + "; ".join(parts) if parts else "unchanged"
