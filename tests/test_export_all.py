"""`cosyvoice-export all`: every registered graph exported, checked and validated; the runtime bundle,
its manifest, resuming, interruption and bad OUTs; the TensorRT profile and cache-key logic."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnx
import onnxruntime as ort
import torch
from click.testing import CliRunner
from torch import Tensor, nn

from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.bundle.tiny import write_bundle
from cosyvoice_export.cli import main
from cosyvoice_export.onnx import bundle_assembly, graph_export, output_dir, trace, trt
from cosyvoice_export.onnx.bundle_assembly import export_all
from cosyvoice_export.onnx.dims import model_dims
from cosyvoice_export.onnx.errors import ExportError
from cosyvoice_export.onnx.export_plan import as_recorded
from cosyvoice_export.onnx.export_report import Report
from cosyvoice_export.onnx.graphs import EXPORT_RECIPES, Networks
from cosyvoice_export.onnx.output_dir import PARTIAL, OutputDirError
from cosyvoice_export.onnx.trace import EXPORTER_VERSION, GraphContractError, check_contract, export_graph
from cosyvoice_export.onnx.validate import (
    GraphValidation,
    TorchReference,
    ValidationError,
    ort_session,
    validate_graph,
)
from cosyvoice_graphs import (
    MAX_BATCH,
    OPTIONAL_SPECS,
    SPECS,
    Case,
    DimRange,
    GraphSpec,
    ModelDims,
    TensorSpec,
    Tolerance,
    metadata,
    precision_plan,
    spec,
)
from cosyvoice_graphs.bundle_layout import MANIFEST, PROMPT_TEXT, PROMPT_WAV
from cosyvoice_graphs.manifest import GraphRecord
from cosyvoice_graphs.precision_plan import PrecisionPlan
from cosyvoice_runtime.bundle import RuntimeBundle, file_sha256
from cosyvoice_runtime.cli import main as run_main


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def graph_metadata(path: Path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


# --- a toy graph: the exporter and validator on their own, in milliseconds -----------------------------

TOY = GraphSpec(
    name="toy", version=3, opset=17, doc="A conv over embeddings plus an input.",
    inputs=(TensorSpec("x", "float32", (1, 4, "n")), TensorSpec("ids", "int64", (1, "n"), low=0, high=10)),
    outputs=(TensorSpec("y", "float32", (1, 4, "n")), TensorSpec("s", "float32", (1, 4))),
    dims={"n": DimRange(1, 8, 64)}, derived={},
    tolerances={"y": Tolerance("max_abs", 1e-5), "s": Tolerance("mean_abs", 1e-5)},
    trace=Case({"n": 5}), validate=(Case({"n": 3}), Case({"n": 11})),
)
TOY_DIMS = ModelDims(llm_hidden=8, llm_layers=1, llm_kv_heads=1, llm_head_dim=8, speech_vocab=10,
                     speech_token_size=8, mel_bins=4, spk_embed_dim=4, pre_lookahead_len=3, token_mel_ratio=2,
                     dit_block_frames=4, dit_dim=8, dit_depth=1, dit_heads=2, dit_head_dim=4,
                     dit_conv_kernel=3, harmonics=2, samples_per_frame=4,
                     sample_rate=16000)


class Toy(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 4)  # > 1 KB: big enough to go to external data
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.scale = scale

    def forward(self, x: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        y = self.conv(x) + self.emb(ids).transpose(1, 2) * self.scale  # (1, 4, n)
        return y, y.mean(-1)


class BakedToy(Toy):
    """Returns `s` as (1, 4) where its spec says (1, n): the contract check must catch the fixed dim."""


BAKED = replace(TOY, outputs=(TOY.outputs[0], TensorSpec("s", "float32", (1, "n"))))


def test_toy_export_is_checked_self_describing_and_validates(tmp_path: Path) -> None:
    out = tmp_path / "toy.onnx"
    result = export_graph(Toy(), TOY, TOY_DIMS, out, extra_metadata={"source_sha256": "ab" * 32})
    assert result.files == (out,) and result.simplified and result.simplify_error is None
    model = onnx.load(str(out))
    assert model.ir_version <= trace.MAX_IR_VERSION
    check_contract(model, TOY)
    y_dims = model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in y_dims] == [1, 4, "n"]
    want = metadata(TOY, TOY_DIMS, {"exporter_version": EXPORTER_VERSION, "source_sha256": "ab" * 32})
    assert graph_metadata(out) == want
    assert not list(tmp_path.glob(f".*{PARTIAL}"))
    validation = validate_graph(out, Toy(), TOY)
    assert validation.passed
    assert {f.case for f in validation.figures} == {"n=3", "n=11"}
    assert {f.output for f in validation.figures} == {"y", "s"}


def test_validation_failure_is_typed_and_names_graph_case_output_and_error(tmp_path: Path) -> None:
    out = tmp_path / "toy.onnx"
    export_graph(Toy(), TOY, TOY_DIMS, out)
    validation = validate_graph(out, Toy(scale=1.01), TOY)  # the reference disagrees with the graph
    assert not validation.passed
    with pytest.raises(ValidationError) as err:
        validation.raise_for_failure()
    e = err.value
    assert e.graph == "toy" and e.figure.output == "y" and e.figure.case == "n=3"
    assert e.figure.measured > e.figure.bound == 1e-5
    assert str(e).startswith("toy: output y at n=3: max_abs error ") and "> bound 1e-05" in str(e)


def test_non_finite_output_fails_validation(tmp_path: Path) -> None:
    class NaNToy(Toy):
        def forward(self, x: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
            y, s = super().forward(x, ids)
            return y, s * float("nan")

    out = tmp_path / "nan.onnx"
    export_graph(NaNToy(), TOY, TOY_DIMS, out)
    failures = validate_graph(out, NaNToy(), TOY).failures
    assert {f.figure.output for f in failures} == {"s"}
    assert "non-finite" in str(failures[0])


def test_baked_dim_is_a_contract_error_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(GraphContractError) as err:
        export_graph(BakedToy(), BAKED, TOY_DIMS, tmp_path / "baked.onnx")
    assert err.value.graph == "toy" and err.value.tensor == "s"
    assert "fixed to 4" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_simplifier_failure_falls_back_and_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    def broken(model: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("simplifier exploded")

    monkeypatch.setattr(trace.onnxslim, "slim", broken)
    result = export_graph(Toy(), TOY, TOY_DIMS, tmp_path / "toy.onnx")
    assert not result.simplified and "simplifier exploded" in (result.simplify_error or "")
    assert validate_graph(result.path, Toy(), TOY).passed


def test_large_graph_gets_external_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "EXTERNAL_DATA_BYTES", 0)
    out = tmp_path / "toy.onnx"
    result = export_graph(Toy(), TOY, TOY_DIMS, out)
    assert result.files == (tmp_path / "toy.onnx.data", out)
    assert (tmp_path / "toy.onnx.data").stat().st_size > 0
    assert validate_graph(out, Toy(), TOY).passed


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_ort_session_refuses_a_provider_fallback(tmp_path: Path) -> None:
    export_graph(Toy(), TOY, TOY_DIMS, tmp_path / "toy.onnx")
    missing = next(p for p in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
                   if p not in ort.get_available_providers())
    with pytest.raises(ExportError, match=f"asked onnxruntime for {missing}, the session uses CPU"):
        ort_session(tmp_path / "toy.onnx", missing)


# --- every registered graph on the tiny bundle --------------------------------------------------------

@pytest.fixture(scope="module")
def networks(tiny_bundle: Path) -> Networks:
    bundle = ModelBundle.open(tiny_bundle)
    return Networks(bundle.config, *(bundle.load_network(n) for n in ("llm", "flow", "hift")))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(SPECS))
def test_export_graph(name: str, networks: Networks, tmp_path: Path) -> None:
    dims = model_dims(networks.config)
    s = spec(name, dims)
    wrapper = EXPORT_RECIPES[name].wrapper(networks)
    result = export_graph(wrapper, s, dims, tmp_path / f"{name}.onnx")
    check_contract(onnx.load(str(result.path)), s)
    assert graph_metadata(result.path) == metadata(s, dims, {"exporter_version": EXPORTER_VERSION})
    validation = validate_graph(result.path, wrapper, s)
    validation.raise_for_failure()
    assert {f.output for f in validation.figures} == set(s.output_names)


def test_every_spec_has_a_wrapper_and_an_export_test() -> None:
    specs = {*SPECS, *OPTIONAL_SPECS}
    assert specs <= set(EXPORT_RECIPES), f"specs without a wrapper: {sorted(specs - set(EXPORT_RECIPES))}"
    (params,) = [m for m in test_export_graph.pytestmark if m.name == "parametrize"]
    assert set(params.args[1]) == set(SPECS), "every registered graph needs a case in test_export_graph"


# --- the runtime bundle -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One `cosyvoice-export all` run on the tiny bundle: OUT and the command's stdout."""
    out = tmp_path_factory.mktemp("runtime") / "bundle"
    code, stdout, stderr = run("all", "--model-dir", str(tiny_bundle), "--out", str(out))
    assert code == 0, stderr
    return out, stdout


def test_all_writes_a_complete_validated_runtime_bundle(exported: tuple[Path, str], tiny_bundle: Path
                                                        ) -> None:
    out, stdout = exported
    manifest = json.loads((out / MANIFEST).read_text())
    assert list(manifest["graphs"]) == list(SPECS)
    for rel, entry in manifest["files"].items():
        path = out / rel
        assert path.is_file(), rel
        assert path.stat().st_size == entry["size"] and file_sha256(path) == entry["sha256"], rel
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*")
               if p.is_file() and p.name != MANIFEST and not p.relative_to(out).parts[0].startswith(".")}
    assert on_disk == set(manifest["files"])
    for name, g in manifest["graphs"].items():
        assert g["file"] == f"graphs/{name}.onnx" and g["spec_version"] == SPECS[name](model_dims(
            ModelBundle.open(tiny_bundle).config)).version
        v = g["validation"]
        assert v["passed"] and v["against"] == "torch" and v["provider"] == "CPUExecutionProvider"
        assert all(o["passed"] and o["measured"] <= o["bound"] for o in v["outputs"].values())
        assert len(v["cases"]) >= 2
    lines = stdout.splitlines()
    for name in SPECS:
        (row,) = [line for line in lines if line.split()[0] == name]
        assert row.endswith("✓") and "exported" in row
    assert manifest["model"]["endofprompt_id"] > 0 and manifest["model"]["sample_rate"] == 24000


def test_runtime_bundle_tables_and_copies(exported: tuple[Path, str], tiny_bundle: Path) -> None:
    out, _ = exported
    manifest = json.loads((out / MANIFEST).read_text())
    dims = model_dims(ModelBundle.open(tiny_bundle).config)
    tables = {n: np.load(out / t["file"]) for n, t in manifest["tables"].items() if "generator" not in t}
    assert all(t.dtype == np.float32 for t in tables.values())
    assert tables["speech_embedding"].shape == (dims.speech_vocab, dims.llm_hidden)
    assert tables["text_embedding"].shape[1] == dims.llm_hidden
    estimator, decoder = spec("flow_estimator_cached", dims), spec("hift_decoder", dims)
    assert tables["flow_noise"].shape == (1, dims.mel_bins, estimator.dims["new_frames"].max)
    sine = next(t for t in decoder.inputs if t.name == "sine_noise")
    assert RuntimeBundle.open(out).uniform_noise("sine_noise").shape == decoder.profile(sine)[2]
    assert manifest["prompt"] == {"wav": PROMPT_WAV, "text": PROMPT_TEXT}
    assert (out / PROMPT_WAV).read_bytes() == (tiny_bundle / PROMPT_WAV).read_bytes()
    for rel in ("frontend/campplus.onnx", "frontend/speech_tokenizer_v3.onnx", "cosyvoice3.yaml",
                "tokenizer/vocab.json"):
        assert rel in manifest["files"]
    assert (out / "frontend/campplus.onnx").read_bytes() == (tiny_bundle / "campplus.onnx").read_bytes()


def test_graph_metadata_matches_spec_and_manifest(exported: tuple[Path, str], tiny_bundle: Path) -> None:
    out, _ = exported
    manifest = json.loads((out / MANIFEST).read_text())
    dims = model_dims(ModelBundle.open(tiny_bundle).config)
    for name in SPECS:
        s = spec(name, dims)
        path = out / "graphs" / f"{name}.onnx"
        meta = graph_metadata(path)
        assert meta.items() >= metadata(s, dims).items()
        assert meta["exporter_version"] == EXPORTER_VERSION == manifest["exporter_version"]
        checkpoint = meta["source_checkpoint"]
        assert checkpoint == {"llm": "llm.pt", "flow": "flow.pt", "hift": "hift.pt"}[name.split("_")[0]]
        assert meta["source_sha256"] == manifest["sources"][checkpoint]["sha256"]
        check_contract(onnx.load(str(path)), s)


def test_second_run_reuses_unchanged_graphs(exported: tuple[Path, str], tmp_path: Path, tiny_bundle: Path
                                            ) -> None:
    out = tmp_path / "bundle"
    shutil.copytree(exported[0], out)
    fresh = json.loads((out / MANIFEST).read_text())
    before = fresh["files"]
    report = export_all(tiny_bundle, out, progress=False)
    assert report.passed and all(g.reused for g in report.graphs)
    assert {rel: {"size": e.size, "sha256": e.sha256} for rel, e in report.files.items()} == before
    # a reused graph's entry reads as the fresh one's, its sources by name
    reused = json.loads((out / MANIFEST).read_text())
    sources = {g: list(e["sources"].items()) for g, e in fresh["graphs"].items()}
    assert {g: list(e["sources"].items()) for g, e in reused["graphs"].items()} == sources
    assert all(items == sorted(items) for items in sources.values())
    assert "reused" in report.table()
    # the summary's bounds as the manifest records them, to three digits (a gate's 45, not 4e+01)
    shown = set(re.findall(r"(\w+) <= (\S+)", report.table()))
    recorded = {(o["metric"], f"{o['bound']:.3g}") for e in fresh["graphs"].values()
                for o in e["validation"]["outputs"].values()}
    assert shown and shown <= recorded, shown - recorded
    forced = export_all(tiny_bundle, out, progress=False, force=True)
    assert forced.passed and not any(g.reused for g in forced.graphs)


def test_a_record_in_an_earlier_format_is_exported_again(exported: tuple[Path, str], tmp_path: Path,
                                                           tiny_bundle: Path) -> None:
    """A graph record that does not read as a `GraphRecord` (here: the figures of an earlier exporter's
    format) is no reason to stop: its graph is exported again, the others are reused."""
    out = tmp_path / "bundle"
    shutil.copytree(exported[0], out)
    before = json.loads((out / MANIFEST).read_text())
    path = out / ".export" / "graph-flow_encoder.json"
    old = json.loads(path.read_text())
    old["validation"] = {"provider": "CPUExecutionProvider", "against": "torch", "figures": [], "gates": []}
    path.write_text(json.dumps(old | {"passed": True}))
    report = export_all(tiny_bundle, out, progress=False)
    assert report.passed
    assert [g.name for g in report.graphs if not g.reused] == ["flow_encoder"]
    after = json.loads((out / MANIFEST).read_text())
    assert after["files"] == before["files"]
    assert after["graphs"]["flow_encoder"]["validation"] == before["graphs"]["flow_encoder"]["validation"]
    assert GraphRecord.from_json(json.loads(path.read_text()), str(path)).validation.passed


def test_export_deletes_the_retired_graphs_of_an_earlier_export(exported: tuple[Path, str], tmp_path: Path,
                                                                 tiny_bundle: Path) -> None:
    """An OUT written before `flow_estimator` was retired: its files, record and TensorRT plans go, so the
    bundle holds exactly what its new manifest lists; the other graphs are reused."""
    out = tmp_path / "bundle"
    shutil.copytree(exported[0], out)
    old = [out / "graphs" / "flow_estimator.onnx", out / "graphs" / "flow_estimator.onnx.data",
           out / ".export" / "graph-flow_estimator.json", out / "trt" / "flow_estimator.0123456789abcdef.plan"
           ]
    for path in old:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"from an earlier exporter")
    kept = out / "trt" / "flow_estimator_cached.0123456789abcdef.plan"
    kept.write_bytes(b"a cached plan of a current graph")
    report = export_all(tiny_bundle, out, progress=False)
    assert report.passed and all(g.reused for g in report.graphs)
    assert not any(path.exists() for path in old) and kept.is_file()
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != MANIFEST
               and p.relative_to(out).parts[0] not in (".export", "trt")}
    assert on_disk == set(json.loads((out / MANIFEST).read_text())["files"])


def test_interrupted_export_leaves_no_manifest(exported: tuple[Path, str], tmp_path: Path, tiny_bundle: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "bundle"
    shutil.copytree(exported[0], out)
    graph = out / "graphs" / "llm.onnx"
    old = graph.read_bytes()

    def interrupted_save(model: onnx.ModelProto, path: Path) -> list[Path]:
        Path(path).write_bytes(model.SerializeToString()[:100])  # half a file, then ^C
        raise KeyboardInterrupt

    monkeypatch.setattr(trace, "_save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        export_all(tiny_bundle, out, progress=False, force=True)
    assert not (out / MANIFEST).exists()
    assert graph.read_bytes() == old
    assert not list(out.rglob(f"*{PARTIAL}*"))
    assert not (out / ".export" / "graph-llm.json").exists()  # no record may describe a file being replaced


def test_failing_graph_exits_nonzero_naming_graph_output_and_error(tiny_bundle: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real = graph_export.validate_against

    def strict(path: Path, reference: TorchReference, *, precision: str) -> GraphValidation:
        v = real(path, reference, precision=precision)  # then hold every output to half the error it has
        return replace(v, figures=tuple(replace(f, bound=f.measured / 2) for f in v.figures))

    monkeypatch.setattr(precision_plan, "SPECS", {"flow_encoder": SPECS["flow_encoder"]})  # one small graph
    monkeypatch.setattr(graph_export, "validate_against", strict)
    out = tmp_path / "out"
    code, stdout, err = run("all", "--model-dir", str(tiny_bundle), "--out", str(out))
    assert code == 1
    (row,) = [line for line in stdout.splitlines() if line.startswith("flow_encoder")]
    assert row.endswith("✗")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors and all(e.startswith("error: flow_encoder: output ") and " > bound " in e for e in errors)
    assert any(e.startswith("error: flow_encoder: output mu at tokens=") for e in errors)
    assert not (out / MANIFEST).exists() and (out / "graphs" / "flow_encoder.onnx").is_file()
    record = out / ".export" / "graph-flow_encoder.json"
    assert not GraphRecord.from_json(json.loads(record.read_text()), str(record)).validation.passed


def test_foreign_or_unwritable_out_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code, _, err = run("all", "--model-dir", str(tiny_bundle), "--out", str(foreign))
    assert code == 2 and err.count("\n") == 1 and "not a runtime bundle" in err
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "foreign.lock").exists()  # refused before its lock was made beside it
    code, _, err = run("all", "--model-dir", str(tiny_bundle), "--out", "/")
    assert (code, err) == (2, "error: /: the file system's root; choose a folder below it\n")
    not_a_folder = re.escape(f"cannot write there ({foreign / 'notes.txt'} is not a folder)")
    with pytest.raises(OutputDirError, match=not_a_folder):
        export_all(tiny_bundle, foreign / "notes.txt" / "out", progress=False)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("wait", [[], ["--wait"]], ids=["", "wait"])
def test_a_lock_that_cannot_be_made_is_one_line_never_a_wait(tiny_bundle: Path, tmp_path: Path,
                                                               wait: list[str]) -> None:
    """Only a lock another export holds means "another export is running"; where no lock file can be made
    at all (filelock takes /proc's "no such file" for a held lock) the export stops in one line, with
    --wait too."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out, why in ((Path("/proc/cosyvoice-out"), "its lock /proc/cosyvoice-out.lock: "),
                     (afile / "sub", f"{afile} is not a folder")):
        code, stdout, err = run("all", "--model-dir", str(tiny_bundle), "--out", str(out), *wait)
        assert (code, stdout) == (2, "")
        assert err.startswith(f"error: {out}: cannot write there ({why}") and err.count("\n") == 1, err
    assert afile.read_text() == "mine"


def test_reuse_from_a_folder_without_export_records_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    """--reuse-from names a folder this command exported into; a model bundle (or a runtime bundle without
    its records) would lend nothing, and is refused in one line before anything is written."""
    out = tmp_path / "out"
    code, stdout, err = run("all", "--model-dir", str(tiny_bundle), "--out", str(out), "--reuse-from",
                            str(tiny_bundle))
    assert (code, stdout) == (2, "")
    assert err == (f"error: --reuse-from {tiny_bundle}: not a runtime bundle with the records of "
                   "`cosyvoice-export all` (.export/); name a folder that command exported into\n")
    assert list(tmp_path.iterdir()) == []


def test_reuse_from_an_export_of_another_model_is_refused(exported: tuple[Path, str], tiny_bundle: Path,
                                                           tmp_path: Path) -> None:
    """Its graphs would all be exported again in silence: said, in one line, before OUT changes."""
    other = write_bundle(tmp_path / "other-model", size="tiny", seed=1)
    out = tmp_path / "out"
    code, stdout, err = run("all", "--model-dir", str(other), "--out", str(out), "--reuse-from",
                            str(exported[0]))
    assert (code, stdout) == (2, "")
    assert err.splitlines()[-1] == (f"error: --reuse-from {exported[0]}: exported from another model "
                                    f"(none of its graphs was made from {other}'s files); name an export of "
                                    "this model")
    assert not out.exists()


def test_a_plan_spelt_as_its_graphs_is_the_bundles_own(exported: tuple[Path, str], tiny_bundle: Path) -> None:
    """`llm=fp32` (or a profile's graphs named one by one) is the plan the bundle was exported with; the
    bundle keeps its recorded name."""
    out = exported[0]
    dims = model_dims(ModelBundle.open(tiny_bundle).config)
    plan = PrecisionPlan.parse("llm=fp32,flow_encoder=fp32")
    specs = {name: spec(name, dims) for name in plan.graph_names}
    assert as_recorded(plan, out, specs).name == "fp32"
    other = PrecisionPlan.parse("flow_estimator_cached=int8")
    assert as_recorded(other, out, {name: spec(name, dims) for name in other.graph_names}) is other


def test_demo_bundle_never_replaces_a_folder_of_other_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("precious")
    monkeypatch.chdir(tmp_path)
    for out, message in ((mine, f"{mine}: not empty and not a runtime bundle"),
                         (Path("."), ".: the working folder or a folder above it")):
        code, _, err = run("demo-bundle", "--out", str(out))
        assert code == 2 and err.startswith(f"error: {message}"), err
    assert [p.name for p in mine.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(("args", "message"), [
    (["--text", " "], "--text: nothing to speak"),
    (["--mode", "instruct2"], "--mode instruct2 needs --instruct, the instruction"),
    (["--prompt-wav", "PROMPT"], "--mode zero-shot needs --prompt-text, the recording's transcript"),
])
def test_synth_refuses_bad_input_before_the_models_load(tiny_bundle: Path, tmp_path: Path, args: list[str],
                                                        message: str) -> None:
    args = [str(tiny_bundle / PROMPT_WAV) if a == "PROMPT" else a for a in args]
    code, _, err = run("synth", "--model-dir", str(tiny_bundle), "--text", "Hi.", "--out",
                       str(tmp_path / "x.wav"), *args)
    assert (code, err) == (2, f"error: {message}\n")
    code, _, err = run("synth", "--model-dir", str(tiny_bundle), "--text", "Hi.", "--out",
                       str(tmp_path / "x.wav"), "--speed", "0")
    assert code == 2 and "0.5<=x<=2.0" in err


def test_an_unreadable_demo_prompt_stops_the_export(tiny_bundle: Path, tmp_path: Path) -> None:
    """The model bundle's prompt is checked as the runtime reads it, before it is copied into a bundle whose
    every synthesis from its own prompt would fail."""
    model = shutil.copytree(tiny_bundle, tmp_path / "model")
    (model / PROMPT_WAV).write_bytes(bytes(range(100)))
    code, stdout, err = run("all", "--model-dir", str(model), "--out", str(tmp_path / "out"))
    assert (code, stdout) == (2, "")
    assert err.startswith(f"error: cannot read audio file {model / PROMPT_WAV}: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_an_interrupted_export_exits_130(tiny_bundle: Path, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) in the middle of an export: click's "Aborted!" and the shell's 130, not 1 (a graph
    that failed validation); no manifest."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "cosyvoice_export", "all", "--model-dir", str(tiny_bundle), "--out",
               str(out)]
    # a process started from a background shell inherits SIGINT ignored: Python installs its handler only
    # where it is not
    export = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lock = output_dir.lock_path(out)
    while not lock.exists() and export.poll() is None:  # the export has begun its work
        time.sleep(0.05)
    export.send_signal(signal.SIGINT)
    stdout, err = export.communicate(timeout=600)
    assert export.returncode == 130, err[-2000:]
    assert err.endswith("\nAborted!\n") and stdout == ""
    assert not (out / MANIFEST).exists()


def test_a_second_export_into_the_same_out_stops_or_waits(tiny_bundle: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A first export (a thread here) holds OUT's lock while it works: a second one stops at once with one
    line, exit 2; another process with --wait says it waits, waits, and then reuses every graph the first
    exported."""
    out, lock = tmp_path / "out", output_dir.lock_path(tmp_path / "out")
    assert lock == tmp_path / "out.lock"
    working, go = threading.Event(), threading.Event()
    real = bundle_assembly._hash_sources

    def held(*args: Any) -> Any:  # the first export, under the lock, until the others have tried
        working.set()
        assert go.wait(600)
        return real(*args)

    monkeypatch.setattr(bundle_assembly, "_hash_sources", held)
    reports: list[Report] = []
    first = threading.Thread(target=lambda: reports.append(export_all(tiny_bundle, out, progress=False)))
    first.start()
    try:
        assert working.wait(600)
        code, stdout, err = run("all", "--model-dir", str(tiny_bundle), "--out", str(out))
        assert (code, stdout) == (2, "")
        assert err == (f"error: {out}: another export into it is running (it holds {lock}); run again when "
                       "it has finished, or pass --wait\n")
        command = [sys.executable, "-m", "cosyvoice_export", "all", "--model-dir", str(tiny_bundle), "--out",
                   str(out), "--wait"]
        waiting = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert waiting.stderr is not None
        said = iter(waiting.stderr.readline, "")  # up to its first line about the lock
        assert next(line for line in said if "export into" in line) == (
            f"waiting for another export into {out} to finish (it holds {lock})\n")
        assert waiting.poll() is None
    finally:
        go.set()
        first.join()
    assert reports[0].passed and not any(g.reused for g in reports[0].graphs)
    stdout, err = waiting.communicate(timeout=600)
    assert waiting.returncode == 0, err
    for name in SPECS:
        (row,) = [line for line in stdout.splitlines() if line.split()[0] == name]
        assert row.endswith("✓") and "reused" in row
    assert lock.is_file() and not (out / lock.name).exists()


def test_llm_rl_exports_the_rl_checkpoint_and_records_it(exported: tuple[Path, str], tiny_bundle: Path,
                                                         tmp_path: Path) -> None:
    """`--llm rl` reads llm.rl.pt (here llm.pt with other values): the manifest names it with its sha256,
    the LLM's graph and tables are its weights, the other graphs are the base export's (reused), and
    `cosyvoice-run --info` prints it."""
    model = shutil.copytree(tiny_bundle, tmp_path / "model")
    generator = torch.Generator().manual_seed(1)
    state = torch.load(model / "llm.pt", weights_only=True)
    rl_state = {k: v + 0.01 * torch.randn(v.shape, generator=generator, dtype=v.dtype)
                for k, v in state.items()}
    torch.save(rl_state, model / "llm.rl.pt")
    out = shutil.copytree(exported[0], tmp_path / "rl")
    code, stdout, err = run("all", "--model-dir", str(model), "--out", str(out), "--llm", "rl")
    assert code == 0, err
    rows = {name: next(line for line in stdout.splitlines() if line.split()[0] == name) for name in SPECS}
    assert "exported" in rows["llm"] and all("reused" in rows[n] for n in SPECS if n != "llm")
    base, rl = RuntimeBundle.open(exported[0]), RuntimeBundle.open(out, verify=True)
    sha = file_sha256(model / "llm.rl.pt")
    assert (base.manifest.llm_checkpoint, rl.manifest.llm_checkpoint) == ("llm.pt", "llm.rl.pt")
    assert rl.manifest.llm_source.sha256 == sha and "llm.pt" not in rl.manifest.sources
    assert rl.manifest.graphs["llm"].sources["llm.rl.pt"] == sha
    assert graph_metadata(rl.graph_path("llm"))["source_checkpoint"] == "llm.rl.pt"
    assert rl.manifest.files["graphs/llm.onnx"] != base.manifest.files["graphs/llm.onnx"]
    np.testing.assert_array_equal(rl.table("speech_embedding"), rl_state["speech_embedding.weight"].float())
    assert not np.array_equal(rl.table("speech_embedding"), base.table("speech_embedding"))
    for name in SPECS:
        if name != "llm":
            assert rl.manifest.files[f"graphs/{name}.onnx"] == base.manifest.files[f"graphs/{name}.onnx"]
    info = CliRunner().invoke(run_main, ["--model", str(out), "--info"])
    assert info.exit_code == 0, info.output
    assert f"llm checkpoint: llm.rl.pt (sha256 {sha})" in info.output.splitlines()


def test_llm_rl_without_its_checkpoint_is_one_line_before_any_work(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, err = run("all", "--model-dir", str(tiny_bundle), "--out", str(out), "--llm", "rl")
    assert (code, stdout) == (2, "")
    assert err == (f"error: {tiny_bundle / 'llm.rl.pt'}: file not found; --llm rl exports it "
                   "(`cosyvoice-export download --llm rl` fetches it)\n")
    assert list(tmp_path.iterdir()) == []  # neither OUT nor its lock


def test_bad_bundle_gives_the_check_bundle_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    code, _, err = run("all", "--model-dir", str(missing), "--out", str(tmp_path / "out"))
    _, _, check_err = run("check-bundle", str(missing))
    assert code == 2 and err == check_err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_all_help_explains() -> None:
    code, out, _ = run("all", "--help")
    assert code == 0
    for option in ("--model-dir", "--out", "--trt", "--force", "--precision", "--providers"):
        assert option in out


# --- TensorRT: what needs no GPU ----------------------------------------------------------------------

def test_input_profiles_cover_exactly_the_symbolic_inputs() -> None:
    assert trt.input_profiles(TOY) == {"x": ((1, 4, 1), (1, 4, 8), (1, 4, 64)),
                                       "ids": ((1, 1), (1, 8), (1, 64))}
    s = spec("hift_decoder", TOY_DIMS)
    profiles = trt.input_profiles(s)
    assert set(profiles) == {t.name for t in s.inputs if t.symbols()}
    assert profiles["sine_noise"] == ((1, 4 * 4, 2), (1, 500 * 4, 2), (1, 3000 * 4, 2))  # derived samples
    estimator = spec("flow_estimator_cached", TOY_DIMS)
    dit_profiles = trt.input_profiles(estimator)
    assert "ode_step" not in dit_profiles
    assert dit_profiles["positions"] == ((1,), (500,), (3000,))
    assert dit_profiles["attention_mask"] == ((1, 1), (500, 500), (3000, 6000))  # new x (cached + new)
    # rows: one stream's CFG pair at opt, up to MAX_BATCH streams' at max
    assert dit_profiles["past_key_0"] == ((2, 2, 0, 4), (2, 2, 0, 4), (2 * MAX_BATCH, 2, 3000, 4))
    assert dit_profiles["spks"] == ((2, 4), (2, 4), (2 * MAX_BATCH, 4))
    conv = dit_profiles["past_pos_conv1"]
    assert conv[0] == conv[1] and conv[2] == (2 * MAX_BATCH, *conv[0][1:])
    for lo, opt, hi in profiles.values():
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True))


def test_plan_cache_key_depends_on_onnx_profile_gpu_and_trt_version_only() -> None:
    profiles = trt.input_profiles(TOY)
    key = trt.plan_cache_key("a" * 64, profiles, "NVIDIA H100 80GB HBM3", "10.9.0")
    assert key == trt.plan_cache_key("a" * 64, dict(reversed(profiles.items())), "NVIDIA H100 80GB HBM3",
                                     "10.9.0")
    assert len(key) == 64 and int(key, 16) >= 0
    retuned = trt.input_profiles(replace(TOY, dims={"n": DimRange(1, 16, 64)}))  # the same graph, opt moved
    others = {trt.plan_cache_key("b" * 64, profiles, "NVIDIA H100 80GB HBM3", "10.9.0"),
              trt.plan_cache_key("a" * 64, retuned, "NVIDIA H100 80GB HBM3", "10.9.0"),
              trt.plan_cache_key("a" * 64, profiles, "NVIDIA L4", "10.9.0"),
              trt.plan_cache_key("a" * 64, profiles, "NVIDIA H100 80GB HBM3", "10.10.0")}
    assert key not in others and len(others) == 4
    assert trt.plan_file_name("llm", key) == f"llm.{key[:16]}.plan"


def test_trt_without_cuda_stops_before_any_work(tmp_path: Path) -> None:
    try:
        trt.require_trt()
    except trt.TrtUnavailable:
        pass
    else:
        pytest.skip("TensorRT and a CUDA device are available here")
    out = tmp_path / "out"
    code, stdout, err = run("all", "--model-dir", str(tmp_path / "no-bundle"), "--out", str(out), "--trt")
    assert code != 0 and stdout == ""
    assert err.count("\n") == 1 and err.startswith("error: --trt needs")
    assert not out.exists()
