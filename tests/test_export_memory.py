"""`cosyvoice-export all --report-memory`: every stage of the export with its time and peak RSS, and the
same bundle as an export without it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

from click.testing import CliRunner

from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.cli import main
from cosyvoice_export.memory import GB, MemoryMonitor, monitor_memory, stage
from cosyvoice_export.onnx import trace
from cosyvoice_export.onnx.dims import model_dims
from cosyvoice_export.onnx.graphs import EXPORT_RECIPES, Networks
from cosyvoice_graphs import SPECS, spec
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.process_memory import rss_bytes

ROW = re.compile(r"^(?P<stage>\S.*?)\s+(?P<seconds>\d+\.\d) s\s+(?P<peak>\d+\.\d\d) GB"
                 r"\s+(?P<after>\d+\.\d\d) GB$")
GRAPH_STEPS = ("load networks", "torch reference", "trace", "check", "onnxslim", "save", "validate", "record")


def _meminfo_bytes() -> int:
    match = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    assert match
    return int(match.group(1)) * 1024


@pytest.mark.skipif(rss_bytes() is None, reason="reads /proc/self/status (Linux)")
def test_report_memory_lists_every_stage_and_changes_no_file(tiny_bundle: Path, runtime_bundle: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "runtime"
    result = CliRunner().invoke(main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                       "--report-memory"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("stage "))) + 1:]
    rows = {m["stage"]: m for m in map(ROW.match, table) if m}
    graphs = [f"{g}: {step}" for g in SPECS for step in GRAPH_STEPS]
    expected = ["check bundle", "hash sources", "tables", *graphs, "frontend, tokenizer", "manifest"]
    assert [name for name in rows if name in expected] == expected  # each once, in the order they ran
    ram = _meminfo_bytes() / GB
    for name, row in rows.items():
        peak, after = float(row["peak"]), float(row["after"])
        assert 0.05 < after <= peak < ram, name
    top = max(rows.values(), key=lambda r: float(r["peak"]))
    summary = next(line for line in table if line.startswith("peak RSS "))
    assert summary.startswith(f"peak RSS {top['peak']} GB in "), summary
    assert float(sum(float(r["seconds"]) for r in rows.values())) > 1

    fresh, plain = RuntimeBundle.open(out, verify=True), RuntimeBundle.open(runtime_bundle)
    assert fresh.manifest.files == plain.manifest.files  # byte for byte the export without the flag


@pytest.mark.skipif(not MemoryMonitor().exact, reason="needs a restartable peak-RSS mark (Linux >= 4.0)")
def test_each_stage_has_its_own_peak() -> None:
    size = 400 * 2**20
    with monitor_memory() as monitor:
        stage("allocate")
        block = np.ones(size, dtype=np.uint8)  # touched: resident
        del block
        stage("after")
    allocate, after = monitor.stages
    assert (allocate.name, after.name) == ("allocate", "after")
    assert allocate.peak_bytes >= monitor.start_bytes + size * 0.9
    assert after.peak_bytes < allocate.peak_bytes - size * 0.5  # the mark restarted when "after" began
    assert monitor.peak_bytes == allocate.peak_bytes
    assert "peak RSS" in monitor.table() and "in allocate" in monitor.table()


def test_stages_outside_a_monitor_are_not_recorded() -> None:
    stage("nowhere")  # no monitor: nothing to do
    with monitor_memory() as monitor:
        pass
    assert monitor.stages == []


@pytest.fixture(scope="module")
def networks(tiny_bundle: Path) -> Networks:
    bundle = ModelBundle.open(tiny_bundle)
    return Networks(bundle.config, *(bundle.load_network(n) for n in ("llm", "flow", "hift")))  # type: ignore[arg-type]


@pytest.mark.parametrize("moved", [4096, 0], ids=["large tensors", "every tensor"])
def test_onnxslim_with_the_weights_on_disk_writes_the_same_graph(networks: Networks, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, moved: int
                                                                 ) -> None:
    """Each graph as onnxslim makes it from the whole graph in memory, byte for byte: with the tiny graphs'
    weights of at least 4 KB on disk (onnxslim reads some of them), and with every tensor on disk (it reads
    and writes back shape constants, and the graph is simplified again in memory)."""
    dims = model_dims(networks.config)
    for name in SPECS:
        s, wrapper = spec(name, dims), EXPORT_RECIPES[name].wrapper
        monkeypatch.setattr(trace, "MOVED_WEIGHT_BYTES", 1 << 62)  # nothing moves: onnxslim as it comes
        whole = trace.export_graph(wrapper(networks), s, dims, tmp_path / "whole" / f"{name}.onnx")
        monkeypatch.setattr(trace, "MOVED_WEIGHT_BYTES", moved)
        light = trace.export_graph(wrapper(networks), s, dims, tmp_path / "light" / f"{name}.onnx")
        assert whole.simplified and light.simplified, name
        assert light.path.read_bytes() == whole.path.read_bytes(), name
