"""What `cosyvoice-export all` will do, settled before any weights are read: the precision plan, the graphs,
TensorRT's or OpenVINO's presence where the plan needs them, the model directory's yaml and LLM checkpoint,
and OUT. Nothing here loads torch or onnx, so a wrong model directory, plan or OUT costs the CLI's start, not
those imports; `bundle_assembly` carries the job out."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cosyvoice_graphs import PRECISIONS, GraphSpec, spec
from cosyvoice_graphs.pipeline import PipelineError, check_runs
from cosyvoice_graphs.precision import FP32
from cosyvoice_graphs.precision_plan import PrecisionPlan, PrecisionPlanError
from cosyvoice_graphs.providers import OPENVINO

from ..bundle.errors import BundleError
from ..bundle.layout import LLM_CHECKPOINTS
from ..bundle.model_dir import ModelBundle
from .bf16 import require_openvino
from .dims import model_dims
from .output_dir import check_out, check_reuse_source, recorded_precision
from .trt import TrtEnv, TrtUnavailable, require_trt


@dataclass(frozen=True)
class ExportJob:
    """An export `plan_export` found possible: what `bundle_assembly.assemble` does under OUT's lock."""

    bundle: ModelBundle
    out: Path
    plan: PrecisionPlan
    graphs: tuple[str, ...]
    """The graphs to export (`bundle_graphs`), in pipeline order."""
    trt_env: TrtEnv | None
    """What the TensorRT plans are built for; None: no plans (no --trt)."""
    reuse_from: tuple[Path, ...]
    start: float
    """`time.perf_counter()` when the export began, for its report's time."""


def plan_export(model_dir: Path | str, out: Path | str, *, llm: str = "base", trt: bool = False,
                precision: str = FP32.name, reuse_from: Sequence[Path | str] = (),
                providers: Sequence[str] | None = None) -> ExportJob:
    """The export of the model directory at `model_dir` into `out` (see `bundle_assembly.export_all` for the
    arguments), or the first reason it cannot run: `PrecisionPlanError`, `TrtUnavailable`, `Bf16Unavailable`,
    `PipelineError`, `BundleError` (`OutputDirError` for `out` or `reuse_from`), in one line. Reads the yaml
    and OUT's records, no weights."""
    plan = PrecisionPlan.parse(precision)
    if llm not in LLM_CHECKPOINTS:
        raise ValueError(f"unknown llm {llm!r}; expected one of {', '.join(LLM_CHECKPOINTS)}")
    for source in reuse_from:
        check_reuse_source(Path(source))
    start = time.perf_counter()
    trt_env = None
    if trt:
        for record in plan.named:
            if not record.trt_plans:
                planned = [name for name, p in PRECISIONS.items() if p.trt_plans]
                raise TrtUnavailable(f"--trt with --precision {plan.name}: {record.name} graphs run on "
                                     f"{record.runs_on}, not as TensorRT plans; --trt takes --precision "
                                     f"{' or '.join(planned)}")
        trt_env = require_trt()
    for record in plan.named:
        if record.cpu_provider == OPENVINO:
            require_openvino(record)
    bundle = ModelBundle.open(model_dir, LLM_CHECKPOINTS[llm])
    specs = {name: spec(name, model_dims(bundle.config)) for name in plan.graph_names}
    plan.check(specs)
    graphs = bundle_graphs(plan, specs, providers, trt)
    if not bundle.checkpoint("llm").is_file():
        raise BundleError(f"{bundle.checkpoint('llm')}: file not found; --llm {llm} exports it "
                          f"(`cosyvoice-export download --llm {llm}` fetches it)")
    out = Path(out)
    plan = as_recorded(plan, out, specs)
    check_out(out, plan.name)  # before its lock is made beside it
    return ExportJob(bundle, out, plan, tuple(graphs), trt_env, tuple(Path(d) for d in reuse_from), start)


def as_recorded(plan: PrecisionPlan, out: Path, specs: Mapping[str, GraphSpec]) -> PrecisionPlan:
    """`plan` under the name OUT's export records, where that plan gives every graph (`specs`: the plan's)
    the same precision (a profile spelt as its graphs, `llm=fp32` for fp32): the same bundle, kept under
    its name; else `plan`."""
    found = recorded_precision(out)
    if found is None or found == plan.name:
        return plan
    try:
        recorded = PrecisionPlan.parse(found)
    except PrecisionPlanError:
        return plan
    same = recorded.graph_names == plan.graph_names and all(
        recorded.precision_of(specs[g]) == plan.precision_of(specs[g]) for g in plan.graph_names)
    return recorded if same else plan


def bundle_graphs(plan: PrecisionPlan, specs: Mapping[str, GraphSpec], providers: Sequence[str] | None,
                  trt: bool) -> list[str]:
    """The graphs of `plan` (`specs`: each one's spec) to export: every one, or, for `providers`, those
    the pipelines on them open (`cosyvoice_graphs.pipeline.check_runs`, which refuses in one line a
    provider that would not run the bundle), in pipeline order."""
    if providers is None:
        return list(plan.graph_names)
    precisions = plan.precisions(specs)
    planned = [name for name, s in specs.items() if trt and builds_plan(s)]
    opened: set[str] = set()
    for provider in providers:
        try:
            opened.update(check_runs(precisions, provider, planned))
        except PipelineError as e:
            built = f"a --precision {plan.name} bundle{' with --trt' * trt}"
            raise PipelineError(f"--providers {provider}: {built} cannot run there: {e}") from None
    return [name for name in plan.graph_names if name in opened]


def builds_plan(s: GraphSpec) -> bool:
    """Whether `--trt` builds a TensorRT plan of graph `s`: not of a graph of onnxruntime's own operators
    (`llm_decode`), which TensorRT cannot parse and the runtime runs on onnxruntime alone."""
    return not s.custom_opsets
