"""`cosyvoice-export all`: a CosyVoice3 model bundle -> a self-contained, torch-free runtime bundle.

The layout is `cosyvoice_graphs.bundle_layout`'s. Under OUT's lock (`output_dir`), the export checks the
model bundle, writes the tables, reuses or exports each graph (`graph_export`), copies the front end,
tokenizer, yaml and prompt, builds the TensorRT plans, and writes the manifest last, only when every graph
passed.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from cosyvoice_graphs import ModelDims, spec
from cosyvoice_graphs.bundle_layout import (
    FRONTEND_DIR,
    MANIFEST,
    PROMPT_TEXT,
    PROMPT_WAV,
    RETIRED_GRAPHS,
    TOKENIZER_DIR,
    TRT_DIR,
    graph_file,
)
from cosyvoice_graphs.manifest import (
    FileEntry,
    Frontend,
    GraphEntry,
    Manifest,
    ModelConstants,
    Prompt,
    Tokenizer,
    TrtPlanEntry,
)
from cosyvoice_graphs.precision import FP32
from cosyvoice_runtime.bundle import file_sha256

from ..bundle.check import check_bundle
from ..bundle.errors import BundleError
from ..bundle.layout import CAMPPLUS, QWEN_DIR, SPEECH_TOKENIZER, YAML
from ..bundle.model_dir import ModelBundle
from ..bundle.tokenizer_files import ENDOFPROMPT, TOKENIZER_FILES, load_cosyvoice3_tokenizer
from ..manifest import NETWORKS
from ..memory import stage
from ..nets.hift import hift_layout
from .bundle_tables import write_tables
from .dims import model_dims
from .export_plan import ExportJob, builds_plan, plan_export
from .export_report import Report
from .graph_export import (
    CONFIG_SOURCES,
    QWEN_CONFIG,
    GraphResult,
    adopt_graph,
    export_and_validate,
    reuse_graph,
    shares_sources,
    validation_record,
)
from .lazy_networks import LazyNetworks
from .output_dir import (
    OutputDirError,
    drop_graphs,
    file_entry,
    install,
    locked,
    prepare_out,
    write_json,
)
from .trace import EXPORTER_VERSION

if TYPE_CHECKING:
    from .trt import TrtEnv

TOKENIZER_COPY = (*TOKENIZER_FILES, QWEN_CONFIG)
"""What the runtime's tokenizer loads, copied from CosyVoice-BlankEN/."""


def export_all(model_dir: Path | str, out: Path | str, *, llm: str = "base", force: bool = False,
               trt: bool = False, precision: str = FP32.name, wait: bool = False, progress: bool = True,
               reuse_from: Sequence[Path | str] = (), providers: Sequence[str] | None = None) -> Report:
    """Export, check and validate every graph of the model bundle at `model_dir` and assemble the
    runtime bundle in `out`.

    The LLM is `llm`'s checkpoint (a key of `LLM_CHECKPOINTS`: `llm.pt`, or the release's `llm.rl.pt`),
    which the manifest records; a missing one is a `BundleError` before anything else is read.

    A graph whose inputs (spec version, source hashes, exporter version) are unchanged since an
    earlier run into `out`, that passed then and whose files are intact, is reused unless `force`, and so
    is one that another export of the model made alike into a folder of `reuse_from` (another precision's
    bundle), its files linked into `out`; the files of graphs an earlier exporter made that this one no
    longer does (`RETIRED_GRAPHS`) are deleted. A folder of `reuse_from` that holds no export records
    (`check_reuse_source`) raises `OutputDirError` before anything is read.

    `providers` (None: every graph of the plan) keeps to the graphs the pipelines on those providers open
    (`bundle_graphs`): a `--precision cpu-fast` bundle for `cpu` has no `llm` (its decode steps and prefills
    run on `llm_decode` and `llm_prefill`); a provider that would not run the plan raises `PipelineError`
    before any weights are read. The files of graphs left out, from an earlier export into `out`, are
    deleted.

    Bad bundles raise `BundleError` (the one-line errors of `check-bundle`); a foreign or unwritable
    `out` raises `OutputDirError`; with `trt` and no CUDA device or TensorRT, or a precision without
    TensorRT plans (`Precision.trt_plans`: int8, int4, bf16), `TrtUnavailable` is raised before anything is
    read or written, and so is `Bf16Unavailable` for a precision validated on OpenVINO (bf16) on a CPU
    without its instructions. Validation failures do not raise: they are in the report, and no manifest is
    written.

    `precision` is a `PrecisionPlan` (a precision, a profile, or `graph=precision,...`); one that names
    something unknown, or gives a graph a precision its spec does not bound, raises `PrecisionPlanError`
    once the model's config is read, before any weights are. A graph in a reduced precision (a key of
    `CONVERSIONS`) gets a body in it (float32 I/O; see `fp16`, `quantize`, `bf16`), validated with its spec's
    bounds for it and, where the spec has them, its decode or solve gates. `out` must not hold a bundle of
    another plan.

    One export writes into `out` at a time: each holds `lock_path(out)` while it runs. When another export
    holds it, this one raises `OutputDirError` before reading anything, or with `wait` says so on stderr and
    waits for it to end (then reuses the graphs it exported).

    `plan_export` settles all of that before torch loads; `assemble` does the work, under OUT's lock.
    """
    job = plan_export(model_dir, out, llm=llm, trt=trt, precision=precision, reuse_from=reuse_from,
                      providers=providers)
    with locked(job.out, wait):
        return assemble(job, force, progress)


def assemble(job: ExportJob, force: bool, progress: bool) -> Report:
    """The work of `export_all`, under `job.out`'s lock (`output_dir.locked`): `job`'s graphs."""
    bundle, out, plan, trt_env, start = job.bundle, job.out, job.plan, job.trt_env, job.start
    stage("check bundle")
    check_bundle(bundle.root, report=lambda line: None, llm_checkpoints=(bundle.llm_checkpoint,))
    stage("hash sources")
    source_sha = _hash_sources(_source_files(bundle), progress)
    for source in job.reuse_from:  # before OUT changes
        if not shares_sources(source, source_sha):
            raise OutputDirError(f"--reuse-from {source}: exported from another model (none of its graphs "
                                 f"was made from {bundle.root}'s files); name an export of this model")
    prepare_out(out, plan.name)
    drop_graphs(out, (*RETIRED_GRAPHS, *(name for name in plan.graph_names if name not in job.graphs)))
    dims = model_dims(bundle.config)
    specs = {name: spec(name, dims) for name in job.graphs}
    nets = LazyNetworks(bundle)

    trt = trt_env is not None  # plans to build: graphs in the operators TensorRT parses
    results: list[GraphResult] = []
    with tqdm(total=len(specs) + 2, desc="runtime bundle", unit="step", disable=not progress) as bar:
        with _step(bar, "tables"):  # first: the LLM they are read from is the first graph's network
            tables, table_files = write_tables(out, bundle, nets, dims)
        for s in specs.values():
            with _step(bar, f"{s.name}: reuse check"):
                nets.next_task()
                p = plan.precision_of(s)
                reused = None if force else reuse_graph(out, s, source_sha, p, trt) or next(
                    (g for d in job.reuse_from if (g := adopt_graph(d, out, s, source_sha, p, trt))), None)
                results.append(reused or export_and_validate(out, s, dims, nets, source_sha, bar, p, trt))
        with _step(bar, "frontend, tokenizer"):
            copied = _copy_files(out, bundle, source_sha)
            prompt, prompt_files = _copy_prompt(out, bundle)
    if trt_env is not None and all(g.validation.passed for g in results):
        stage("tensorrt")
        _build_plans(out, results, trt_env, progress)

    files = {rel: e for g in results for rel, e in g.files.items()} | table_files | copied | prompt_files
    files |= {g.trt.file: FileEntry(g.trt.size, g.trt.sha256) for g in results if g.trt}
    report = Report(out, tuple(results), None, time.perf_counter() - start, files)
    if not report.passed:
        return report
    stage("manifest")
    manifest = Manifest(
        exporter_version=EXPORTER_VERSION,
        precision=plan.name,
        llm_checkpoint=bundle.llm_checkpoint,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        model=_model_constants(bundle, dims),
        sources=source_sha,
        graphs={g.name: _graph_entry(g) for g in results},
        tables=tables,
        frontend=Frontend(campplus=f"{FRONTEND_DIR}/{CAMPPLUS}",
                          speech_tokenizer=f"{FRONTEND_DIR}/{SPEECH_TOKENIZER}"),
        tokenizer=Tokenizer(TOKENIZER_DIR, TOKENIZER_COPY),
        config=YAML,
        prompt=prompt,
        files=dict(sorted(files.items())),
        timings={"total_s": round(time.perf_counter() - start, 3)},
    )
    write_json(out, MANIFEST, manifest.to_json())
    return Report(out, tuple(results), out / MANIFEST, time.perf_counter() - start, files)


@contextmanager
def _step(bar: tqdm, label: str) -> Iterator[None]:
    bar.set_postfix_str(label)
    stage(label)
    yield
    bar.update()


# --- inputs --------------------------------------------------------------------------------------------

def _source_files(bundle: ModelBundle) -> dict[str, Path]:
    """Every model-bundle file the runtime bundle is made from, by its path in the model bundle."""
    names = [*CONFIG_SOURCES, *(bundle.checkpoint_file(n) for n in NETWORKS), CAMPPLUS, SPEECH_TOKENIZER,
             *(f"{QWEN_DIR}/{n}" for n in TOKENIZER_FILES)]
    return {n: bundle.root / n for n in names}


def _hash_sources(files: Mapping[str, Path], progress: bool) -> dict[str, FileEntry]:
    total = sum(p.stat().st_size for p in files.values())
    with tqdm(total=total, desc="hashing sources", unit="B", unit_scale=True, disable=not progress) as bar:
        return {n: FileEntry(p.stat().st_size, file_sha256(p, bar.update)) for n, p in files.items()}


# --- copies and plans ----------------------------------------------------------------------------------

def _copy_files(out: Path, bundle: ModelBundle, source_sha: Mapping[str, FileEntry]) -> dict[str, FileEntry]:
    """The frontend models, tokenizer files and yaml, copied and checked against their source hashes."""
    copies = {f"{FRONTEND_DIR}/{CAMPPLUS}": CAMPPLUS, f"{FRONTEND_DIR}/{SPEECH_TOKENIZER}": SPEECH_TOKENIZER,
              YAML: YAML, **{f"{TOKENIZER_DIR}/{n}": f"{QWEN_DIR}/{n}" for n in TOKENIZER_COPY}}
    files = {}
    for rel, src in copies.items():
        with open(bundle.root / src, "rb") as source:
            entry = install(out, rel, partial(shutil.copyfileobj, source))
        if entry.sha256 != source_sha[src].sha256:
            raise BundleError(f"{bundle.root / src}: changed while the export was running")
        files[rel] = entry
    return files


def _copy_prompt(out: Path, bundle: ModelBundle) -> tuple[Prompt | None, dict[str, FileEntry]]:
    """The model bundle's demo prompt and transcript, when it has both (ours do; upstream's has none)."""
    if not all((bundle.root / rel).is_file() for rel in (PROMPT_WAV, PROMPT_TEXT)):
        return None, {}
    files = {}
    for rel in (PROMPT_WAV, PROMPT_TEXT):
        with open(bundle.root / rel, "rb") as source:
            files[rel] = install(out, rel, partial(shutil.copyfileobj, source))
    return Prompt(PROMPT_WAV, PROMPT_TEXT), files


def _build_plans(out: Path, results: list[GraphResult], env: TrtEnv, progress: bool) -> None:
    """A TensorRT plan per graph that has one (`builds_plan`; from the cache where it has one), validated
    against onnxruntime."""
    from .trt import build_plan, validate_plan

    planned = [g for g in results if builds_plan(g.spec)]
    for g in tqdm(planned, desc="tensorrt", unit="graph", disable=not progress):
        onnx_path = out / graph_file(g.name)
        plan = build_plan(onnx_path, g.spec, out / TRT_DIR, env)
        start = time.perf_counter()
        g.trt_validation = validate_plan(plan.path, onnx_path, g.spec)
        entry = file_entry(plan.path)
        g.trt = TrtPlanEntry(str(plan.path.relative_to(out)), entry.size, entry.sha256, plan.key, plan.cached,
                             env.gpu_name, env.trt_version, round(plan.seconds, 3),
                             round(time.perf_counter() - start, 3), validation_record(g.trt_validation))


# --- the manifest --------------------------------------------------------------------------------------

def _graph_entry(g: GraphResult) -> GraphEntry:
    r = g.record
    return GraphEntry(file=next(iter(r.files)), precision=g.precision, spec_name=g.spec.name,
                      spec_version=g.spec.version, opset=g.spec.opset, sources=r.inputs.sources,
                      simplified=r.simplified, simplify_error=r.simplify_error, reused=g.reused,
                      timings=r.timings, validation=r.validation, trt=g.trt)


def _model_constants(bundle: ModelBundle, dims: ModelDims) -> ModelConstants:
    llm = bundle.config.llm
    tokenizer = load_cosyvoice3_tokenizer(bundle.qwen_dir)
    return ModelConstants(dims, sos=llm.sos, eos=llm.eos, task_id=llm.task_id,
                          endofprompt_id=tokenizer.token_id(ENDOFPROMPT),
                          hift=hift_layout(bundle.config.hift))
