"""`cosyvoice_bench.graph_calls`: every graph call of a block recorded by graph, from every thread, and the
share of a window each graph's calls covered."""

from __future__ import annotations

import threading
from importlib.util import find_spec

import numpy as np
import onnxruntime as ort
import pytest

from cosyvoice_bench.graph_calls import ANY, DEVICE_COPIES, covered, in_flight, record
from cosyvoice_bench.report import _graph_time
from cosyvoice_graphs import HIFT_F0
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.demo import DEMO_BUNDLE
from cosyvoice_runtime.runners import OrtRunner
from cosyvoice_runtime.runners.device_copies import RowConcat


def test_covered_counts_overlapping_calls_once_and_only_inside_the_window() -> None:
    calls = [(1.0, 3.0), (2.0, 4.0), (6.0, 7.0), (0.0, 0.5), (6.5, 9.0)]
    assert covered(calls, 0.0, 10.0) == pytest.approx(0.5 + 3.0 + 3.0)
    assert covered(calls, 2.5, 8.0) == pytest.approx(1.5 + 2.0)  # clipped at both ends
    assert covered([(1.0, 2.0), (1.2, 1.5)], 0.0, 10.0) == pytest.approx(1.0)  # one inside another
    assert covered([], 0.0, 1.0) == 0.0


def test_in_flight_gives_each_graphs_share_and_their_union() -> None:
    figures = in_flight({"b": [(0.0, 2.0), (1.0, 3.0)], "a": [(2.0, 6.0)]}, 0.0, 8.0)
    assert list(figures) == ["a", "b", ANY]
    assert figures["a"] == {"calls": 1, "call_ms_mean": pytest.approx(4000.0), "share": pytest.approx(0.5)}
    assert figures["b"] == {"calls": 2, "call_ms_mean": pytest.approx(2000.0), "share": pytest.approx(3 / 8)}
    assert figures[ANY] == {"calls": 3, "call_ms_mean": pytest.approx(8000 / 3),
                            "share": pytest.approx(6 / 8)}
    with pytest.raises(ValueError, match="an empty window"):
        in_flight({}, 1.0, 1.0)


def test_every_call_is_recorded_by_graph_from_every_thread_and_the_methods_come_back() -> None:
    demo = RuntimeBundle.open(DEMO_BUNDLE)
    runner = OrtRunner(demo.graph_path(HIFT_F0), demo.specs[HIFT_F0], threads=1)
    feeds = runner.spec.sample_inputs(runner.spec.validate[0])
    # another session of the graph, made from its bytes: a graph is named by its metadata, not its file
    other = ort.InferenceSession(demo.graph_path(HIFT_F0).read_bytes(), providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in other.get_inputs()]
    expected = runner.infer(feeds)
    original = ort.InferenceSession.run
    with record() as calls:
        with pytest.raises(RuntimeError, match="already being recorded"):
            with record():
                pass
        threads = [threading.Thread(target=runner.infer, args=(feeds,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        runner.infer_kept(feeds, [])  # through IOBinding
        binding = other.io_binding()
        binding.bind_cpu_input(name, feeds[name])
        binding.bind_output(runner.spec.output_names[0])
        other.run_with_iobinding(binding)
        (f0,) = other.run(None, {name: feeds[name]})  # results pass through
    assert np.array_equal(f0, expected[runner.spec.output_names[0]])
    assert list(calls) == [HIFT_F0] and len(calls[HIFT_F0]) == 6
    assert all(end >= start for made in calls.values() for start, end in made)
    assert ort.InferenceSession.run is original and "run" not in vars(ort.InferenceSession)
    runner.infer(feeds)
    assert len(calls[HIFT_F0]) == 6  # nothing recorded after the block
    runner.close()


def test_the_runtimes_device_copies_are_recorded_as_such() -> None:
    pytest.importorskip("onnx", reason="the runtime builds its copy graphs with the onnx package")
    concat = RowConcat({"x": (np.dtype(np.float32), 2)})
    parts = [{"x": np.full((1, 3), float(i), np.float32)} for i in range(2)]
    with record() as calls:
        joined = concat(parts)
    assert np.array_equal(joined["x"].numpy(), [[0, 0, 0], [1, 1, 1]])
    assert list(calls) == [DEVICE_COPIES] and len(calls[DEVICE_COPIES]) == 1


@pytest.mark.skipif(find_spec("openvino") is None, reason="the openvino extra is not installed")
def test_openvino_runners_calls_are_recorded_by_graph() -> None:
    from cosyvoice_runtime.runners import OpenVinoRunner

    demo = RuntimeBundle.open(DEMO_BUNDLE)
    runner = OpenVinoRunner(demo.graph_path(HIFT_F0), demo.specs[HIFT_F0], "fp32")
    original = vars(OpenVinoRunner)["_run"]
    with record() as calls:
        runner.infer(runner.spec.sample_inputs(runner.spec.validate[0]))
    assert list(calls) == [HIFT_F0] and len(calls[HIFT_F0]) == 1
    assert vars(OpenVinoRunner)["_run"] is original  # its own method again


def test_the_graphs_table_has_a_column_per_graph_in_the_pipelines_order() -> None:
    graphs = in_flight({"hift_decoder": [(1.0, 2.0)], "llm": [(0.0, 1.0), (0.5, 1.5)]}, 0.0, 4.0)
    rows = [{"level": 2, "graphs": graphs, "batched": {"graphs": graphs}, "batched_window": None}]
    title, header, _, unbatched, batched = _graph_time(rows)
    assert header.split() == ["sessions", "run", ANY, "llm", "hift_decoder"]
    assert unbatched.split() == ["2", "unbatched", "50%", "(3", "x", "1000", "ms)", "38%", "(2", "x", "1000",
                                 "ms)", "25%", "(1", "x", "1000", "ms)"]
    assert batched.split()[:2] == ["2", "batched"] and "where the sessions' wall went" in title
    assert _graph_time([{"level": 1, "graphs": None, "batched": None}]) == []
