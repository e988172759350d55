"""`cosyvoice-golden`: check the runtime against the golden cases, or record them again.

`check` runs on the runtime alone (numpy + onnxruntime); `update` also needs the `export` extra (torch),
which is imported only when it runs. Exit status: 0 all passed, 1 a case or graph failed (or was not
recorded; a case whose synthesis fails is a failed case), 2 bad input (one line on stderr), 130
interrupted (Ctrl-C).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from tqdm import tqdm

from cosyvoice_graphs.bundle_layout import MANIFEST
from cosyvoice_graphs.precision import FP32
from cosyvoice_graphs.precision_plan import PrecisionPlan, PrecisionPlanError
from cosyvoice_runtime.atomic_files import check_writable
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.bundle_source import bundle_front
from cosyvoice_runtime.cli_options import THREADS, NonEmptyPath, one_line_errors
from cosyvoice_runtime.errors import USER_ERRORS, FeedError, SynthesisError
from cosyvoice_runtime.extras import install_command
from cosyvoice_runtime.runners import PROVIDERS, graphs_run, open_runner

from .cases import CASES_FILE, DEMO, Cases, GoldenCase, load_cases, loosest
from .compare import Verdict, compare_case, compare_graph, not_exact
from .errors import GoldenError
from .run import Runtime
from .store import (
    EXPECTATION_FIELDS,
    GRAPHS_DIR,
    CaseGolden,
    GraphGolden,
    case_paths,
    check_model_files,
    check_same_model,
    fingerprint,
    graph_paths,
    read_case,
    read_graph,
)

SYNTHESIS_ERRORS = (SynthesisError, FeedError)
"""What a synthesis that was given good input raises when it fails (the LLM sampling what upstream
refuses, a request beyond the noise tables, a graph fed wrongly): the failure of the case it ran in."""

if TYPE_CHECKING:  # update imports torch only when it runs
    from cosyvoice_export.reference.pipeline import ReferencePipeline


def _user_errors() -> AbstractContextManager[None]:
    """Bad input, the runtime's and ours (cases, precision plans): one line on stderr, exit status 2."""
    return one_line_errors(GoldenError, PrecisionPlanError, *USER_ERRORS)


def _selection(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options `check` and `update` share: which cases file, cases, graphs and bundle."""
    options = [
        click.option("--cases", "cases_file", type=NonEmptyPath(dir_okay=False, path_type=Path),
                     default=CASES_FILE, show_default="the package's cases.toml",
                     help="Cases file; its golden data lives in data/ beside it."),
        click.option("--case", "case_names", multiple=True, metavar="NAME",
                     help="Only this case (repeatable). Default: every case and graph."),
        click.option("--graph", "graph_names", multiple=True, metavar="NAME",
                     help="Only this graph's golden bundle (repeatable)."),
        click.option("--model", type=NonEmptyPath(file_okay=False, path_type=Path),
                     help="Runtime bundle to use instead of every case's own, or a model bundle (exported on "
                          "first use, as cosyvoice-run --model does; needs the export extra)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _select(cases: Cases, case_names: tuple[str, ...], graph_names: tuple[str, ...]
            ) -> tuple[list[GoldenCase], list[str]]:
    """The cases and graphs asked for: all of both when neither is named."""
    if not case_names and not graph_names:
        return cases.select(()), cases.select_graphs(())
    return (cases.select(case_names) if case_names else [],
            cases.select_graphs(graph_names) if graph_names else [])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Golden-output regression for the CosyVoice3 runtime.

    Each case of cases.toml pins a synthesis (bundle, text, prompt, mode, streaming and chunk policy,
    sampling, speed, provider, precision); its golden holds the torch reference's speech tokens, chunk
    boundaries and audio, and the reference backend's PCM16 hashes and graph statistics. Each graph of
    the specs has a golden bundle of inputs and torch outputs.
    """


@main.command()
@_selection
@click.option("--provider", type=click.Choice(PROVIDERS),
              help="Backend to check on instead of each case's own: cpu, cuda, tensorrt (onnxruntime), "
                   "openvino, or trt (the bundle's TensorRT plans).")
@click.option("--threads", type=THREADS,
              help="onnxruntime intra-op threads. Default: the reference backend's (cases.toml).")
@click.option("--precision", metavar="PRECISION",
              help="Judge the cases on a bundle exported with this --precision (an export of the same model, "
                   "e.g. cosyvoice-export all --precision int8, or llm=int8,dit=int8) by tolerance, whatever "
                   "precision they were recorded on: the loosest of cases.toml's [precision_tolerance] "
                   "bounds of the bundle's reduced precisions (int4 has none: an int4 LLM's tokens leave "
                   "torch's within a few steps, so its cases fail; its export gates judge it). It must be "
                   "the precision the bundle's manifest records. Default: a case runs only on a bundle of "
                   "its own precision.")
def check(cases_file: Path, case_names: tuple[str, ...], graph_names: tuple[str, ...], model: Path | None,
          provider: str | None, threads: int | None, precision: str | None) -> None:
    """Replay the golden cases on the runtime (no torch) and judge them: one line per case and graph.

    Speech tokens and chunk boundaries must equal the golden's, the audio must be within the backend's
    bounds of the torch reference's, and on the reference backend every chunk's PCM16 sha256 and every
    graph's output statistics must be identical. A graph is judged with its spec's bounds for the
    precision the bundle's manifest gives it.
    """
    start = time.perf_counter()
    with _user_errors():
        if precision is not None:
            precision = PrecisionPlan.parse(precision).name
        cases = load_cases(cases_file)
        selected, graphs = _select(cases, case_names, graph_names)
        threads = threads or cases.reference.threads
        with Runtime(cases, model=model, provider=provider, threads=threads) as runtime:
            if model is not None:
                _check_model_files(cases, runtime, model, selected, graphs)
            # every golden is read and matched to its bundle before anything runs
            goldens = [(case, _case_golden(cases, runtime, case, precision)) for case in selected]
            graphs = _graphs_run(cases, runtime, graphs)
            graph_goldens = [_graph_golden(cases, runtime, g) for g in graphs]
            if graph_goldens:
                _check_precision(runtime.open_bundle(cases.graph_bundle), precision)
            verdicts = []
            with tqdm(total=len(goldens) + len(graph_goldens), desc="golden check", unit="case",
                      disable=None, leave=False) as bar:
                for case, golden in goldens:
                    verdicts.append(_check_case(cases, runtime, case, golden))
                    _report(bar, verdicts[-1])
                for golden_graph in graph_goldens:
                    verdicts.append(_check_graph(cases, runtime, golden_graph))
                    _report(bar, verdicts[-1])
    judged = [v for v in verdicts if v.judged]
    failed = sum(not v.passed for v in judged)
    where = f"{provider or 'each case’s provider'}, {threads} thread{'s' * (threads > 1)}"
    unjudged = f", {len(verdicts) - len(judged)} not judged" if len(judged) < len(verdicts) else ""
    click.echo(f"{len(judged) - failed} of {len(judged)} passed{unjudged} ({where}) in "
               f"{time.perf_counter() - start:.1f} s")
    if failed:
        sys.exit(1)


def _report(bar: tqdm, verdict: Verdict) -> None:
    with bar.external_write_mode():
        click.echo(verdict.line())
    bar.update()


def _check_model_files(cases: Cases, runtime: Runtime, model: Path, selected: list[GoldenCase],
                       graphs: list[str]) -> None:
    """Where `model` is a model bundle, whose export takes minutes, a `GoldenError` before it unless it holds
    the source files the selected goldens were recorded from (`check_model_files`); after the export,
    `check_same_model` holds the goldens against it as against a runtime bundle."""
    if bundle_front(model).dims is not None:  # a runtime bundle: its manifest tells at once
        return
    update = runtime.update_command()
    recorded = {str(case_paths(cases.data_dir, c.name)[0]): read_case(cases.data_dir, c.name, update).bundle
                for c in selected}
    recorded |= {str(graph_paths(cases.data_dir, g)[0]): read_graph(cases.data_dir, g, update).bundle
                 for g in graphs}
    check_model_files(recorded, model, update)


def _case_golden(cases: Cases, runtime: Runtime, case: GoldenCase, precision: str | None) -> CaseGolden:
    """The golden of `case`, checked against the case as it now reads and against its bundle, which must
    have the case's precision or `precision` (judged by tolerance)."""
    golden = read_case(cases.data_dir, case.name, runtime.update_command())
    where = str(case_paths(cases.data_dir, case.name)[0])
    bundle = runtime.bundle(case)
    check_same_model(golden.bundle, bundle, where, runtime.update_command())
    _check_precision(bundle, precision)
    found = _judged_as(bundle)
    if found not in (case.precision, precision):
        raise GoldenError(f"case {case.name} is for {case.precision} graphs; {bundle.root} is {found} (to "
                          f"judge it by tolerance: --precision {found})")
    now = case.to_json()
    stale = [k for k in EXPECTATION_FIELDS if golden.case.get(k) != now[k]]
    prompt = runtime.prompt(case)
    if golden.prompt != {"wav_sha256": prompt.wav_sha256, "text": prompt.text}:
        stale.append(f"prompt {prompt.wav.name}")
    if stale:
        raise GoldenError(f"{where} is stale: {', '.join(stale)} changed since it was recorded (record it "
                          f"again with `{runtime.update_command('--case', case.name)}`)")
    runtime.segments(case)  # text the tokenizer refuses is bad input, refused before anything runs
    return golden


def _check_precision(bundle: RuntimeBundle, precision: str | None) -> None:
    """Refuse a `--precision` other than the one `bundle` was exported with (its manifest's): the flag
    says which bounds judge the bundle, and bounds of another precision would judge it wrongly."""
    found = fingerprint(bundle)["precision"]
    if precision is not None and precision != found:
        raise GoldenError(f"--precision {precision}: {bundle.root} was exported with --precision {found} "
                          f"(its manifest); give --precision {found}")


def _judged_as(bundle: RuntimeBundle) -> str:
    """The precision that judges `bundle`: the one its graphs share, where they share one (`--precision
    decode=fp32` leaves every graph fp32), else its manifest's."""
    graphs = {p.name for p in bundle.graph_precisions.values()}
    return graphs.pop() if len(graphs) == 1 else fingerprint(bundle)["precision"]


def _graphs_run(cases: Cases, runtime: Runtime, graphs: list[str]) -> list[str]:
    """The graphs of `graphs` that the pipeline runs on the check's provider (`graphs_run`); a line for each
    it does not (on CUDA an `llm_decode` takes the decode steps where `llm` would)."""
    provider = runtime.provider or cases.reference.provider
    run_there = graphs_run(runtime.open_bundle(cases.graph_bundle), provider)
    for graph in graphs:
        if graph not in run_there:
            click.echo(f"- graph {graph:<28} not checked: the pipeline does not run it on {provider}")
    return [g for g in graphs if g in run_there]


def _graph_golden(cases: Cases, runtime: Runtime, graph: str) -> GraphGolden:
    """The golden bundle of `graph`, checked against the cases file, the bundle and its spec."""
    golden = read_graph(cases.data_dir, graph, runtime.update_command())
    where = str(graph_paths(cases.data_dir, graph)[0])
    remedy = f"record it again with `{runtime.update_command('--graph', graph)}`"
    bundle = runtime.open_bundle(cases.graph_bundle)
    check_same_model(golden.bundle, bundle, where, runtime.update_command())
    version = bundle.specs[graph].version
    if golden.spec_version != version:
        raise GoldenError(f"{where} holds spec {graph} version {golden.spec_version}; {bundle.root} has "
                          f"version {version} ({remedy})")
    if tuple(c.index for c in golden.cases) != cases.graphs[graph]:
        raise GoldenError(f"{where} holds cases {[c.index for c in golden.cases]}, {cases.path.name} asks "
                          f"for {list(cases.graphs[graph])} ({remedy})")
    return golden


def _check_case(cases: Cases, runtime: Runtime, case: GoldenCase, golden: CaseGolden) -> Verdict:
    provider, bundle = runtime.provider_of(case), runtime.bundle(case)
    precision = _judged_as(bundle)
    moved_draws = None
    if precision != case.precision:
        reduced = sorted({bundle.graph_precision(g).name for g in bundle.specs} - {FP32.name})
        unbounded = [p for p in reduced if p not in cases.precision_tolerance]
        if unbounded or not reduced:
            missing = ", ".join(unbounded) or precision
            return Verdict(case.name, False, f"{missing}: no tolerance", f"{cases.path.name} gives no "
                           f"bounds for {missing} graphs (add [precision_tolerance] {missing})")
        bounds = loosest([cases.precision_tolerance[p] for p in reduced])
        moved_draws = precision if case.sampling != "greedy" else None
    elif provider in case.tolerance:
        bounds = case.tolerance[provider]
    else:
        return Verdict(case.name, False, f"{provider}: no tolerance", f"{cases.path.name} gives no "
                       f"bounds for {provider} (add [tolerance] {provider} or the case's own)")
    try:
        run = runtime.run(case)
    except SYNTHESIS_ERRORS as e:
        return Verdict(case.name, False, f"{provider}: synthesis failed", str(e))
    return compare_case(golden, run, provider, bounds,
                        not_exact(golden, bundle, provider, runtime.threads, cases.reference),
                        moved_draws=moved_draws)


def _check_graph(cases: Cases, runtime: Runtime, golden: GraphGolden) -> Verdict:
    bundle = runtime.open_bundle(cases.graph_bundle)
    spec = bundle.specs[golden.graph]
    precision = bundle.graph_precision(golden.graph)
    provider = runtime.provider or cases.reference.provider
    with open_runner(bundle, golden.graph, provider, threads=runtime.threads) as runner:
        return compare_graph(golden, runner, spec.tolerances_on(precision.name, provider))


@main.command()
@_selection
@click.option("--model-dir", type=NonEmptyPath(file_okay=False, path_type=Path),
              help="The model bundle (upstream's model directory) the runtime bundle was exported from, "
                   "for the torch reference. Not needed for the demo bundle (its model is rebuilt from its "
                   "recipe: cosyvoice-export tiny-bundle, seed 0) nor when --model is the model bundle.")
def update(cases_file: Path, case_names: tuple[str, ...], graph_names: tuple[str, ...], model: Path | None,
           model_dir: Path | None) -> None:
    """Record the golden data of the selected cases and graphs from the torch reference pipeline.

    The runtime must agree with torch on the reference backend (tokens and chunk boundaries exactly, the
    audio within the case's bounds) or nothing is written for that case. A golden is rewritten only when
    it changed; each line says what changed. Needs the export extra (torch).
    """
    with _user_errors():
        cases = load_cases(cases_file)
        selected, graphs = _select(cases, case_names, graph_names)
        check_writable(cases.data_dir, "the cases' data folder", directory=True)  # before torch's work
        if graphs:
            check_writable(cases.data_dir / GRAPHS_DIR, "the graphs' data folder", directory=True)
        try:
            from .reference import demo_model, open_pipeline
            from .update import record_case, record_graph
        except ImportError as e:
            raise GoldenError(f"update needs the export extra ({install_command('export')}): "
                              f"{e.name} is not installed") from None
        ref = cases.reference
        failed = 0
        with (Runtime(cases, model=model, provider=ref.provider, threads=ref.threads) as runtime,
              tempfile.TemporaryDirectory(prefix="cosyvoice-golden-") as work):
            pipes: dict[Path, ReferencePipeline] = {}

            def pipeline(value: str) -> ReferencePipeline:
                """The torch reference of the model bundle `value` (a cases-file bundle) was exported from."""
                bundle = runtime.open_bundle(value)
                if bundle.root not in pipes:
                    if model_dir is not None:
                        source = model_dir
                    elif model is not None and not (model / MANIFEST).is_file():
                        source = model  # a model bundle, exported for the runtime by `open_bundle`
                    elif model is None and value == DEMO:
                        source = demo_model(Path(work))
                    else:
                        raise GoldenError(f"update needs --model-dir: the model bundle {bundle.root} was "
                                          "exported from")
                    pipes[bundle.root] = open_pipeline(source, bundle)
                return pipes[bundle.root]

            with tqdm(total=len(selected) + len(graphs), desc="golden update", unit="case", disable=None,
                      leave=False) as bar:
                for case in selected:
                    bar.set_postfix_str(case.name)
                    precision = _judged_as(runtime.bundle(case))
                    if precision != case.precision:
                        raise GoldenError(f"case {case.name} is for {case.precision} graphs; "
                                          f"{runtime.bundle(case).root} is {precision}")
                    pipe = pipeline(case.bundle)
                    try:
                        recorded = record_case(cases, runtime, pipe, case)
                    except SYNTHESIS_ERRORS as e:  # a golden cannot record a failure: stop, naming the case
                        raise GoldenError(f"case {case.name}: {e}") from None
                    failed += not recorded.verdict.passed
                    _report(bar, recorded.verdict)
                for graph in graphs:
                    bar.set_postfix_str(graph)
                    recorded = record_graph(cases, runtime.open_bundle(cases.graph_bundle),
                                            pipeline(cases.graph_bundle), graph)
                    _report(bar, recorded.verdict)
    if failed:
        sys.exit(1)
