"""The batch's decode steps through fixed bindings, which CUDA graphs replay
(`cosyvoice_runtime.decode_graphs`): on the CPU the same calls as the runtime's own, bit for bit; on CUDA
(skipped elsewhere) captured and replayed. The option is refused, before anything opens, where it cannot
work."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnxruntime as ort

from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.decode_batch import SlotBuffers
from cosyvoice_runtime.decode_graphs import CAPTURE_RUNS, GraphedSteps
from cosyvoice_runtime.errors import UserError
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.llm import LlmRequest
from cosyvoice_runtime.runners import CPU, CUDA, OrtRunner
from cosyvoice_runtime.runners.capture_gate import GATE
from cosyvoice_runtime.runners.ort import GPU_GRAPH_ID, SKIP_GRAPH
from cosyvoice_runtime.sampling import GreedySampler
from cosyvoice_runtime.synthesis import Synthesizer, uses_cuda_graphs

needs_cuda = pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                                reason="needs onnxruntime's CUDA provider (onnxruntime-gpu and a GPU)")


def _fill(buffers: SlotBuffers, lengths: list[int], seed: int) -> None:
    """Random caches of `lengths` positions in the first rows of `buffers`."""
    rng = np.random.default_rng(seed)
    for array in buffers.arrays.values():
        array[...] = rng.uniform(-1, 1, array.shape).astype(array.dtype)
    buffers.lengths[:] = lengths


def test_bound_steps_are_the_runtimes_calls(fp16_decode_bundle: Path) -> None:
    """Steps of 3, 3, 2, 3 and 2 rows through `GraphedSteps` against the same steps as the runtime
    makes them (`extend_rows`) on a twin of the buffers: the same log-probs and caches, bit for bit. A
    binding is made once per number of rows and kept; buffers replaced by longer ones release them all."""
    bundle = RuntimeBundle.open(fp16_decode_bundle)
    with Synthesizer(bundle, threads=1) as synth:
        lm = synth.lm
        assert lm.in_place is not None
        graphed = GraphedSteps(lm.in_place)
        twins = [SlotBuffers(lm.spec, 3, 64, lm.max_positions) for _ in range(2)]
        for buffers in twins:
            _fill(buffers, [5, 17, 9], seed=0)
        rng = np.random.default_rng(1)
        width = lm.speech_embedding.shape[1]
        for rows in (3, 3, 2, 3, 2):
            embeds = rng.uniform(-1, 1, (rows, 1, width)).astype(np.float32)
            lengths = np.array(twins[0].lengths[:rows], dtype=np.int64)
            got = graphed.step(embeds, lengths, twins[0].views(0, rows))
            want = lm.extend_rows(embeds, lengths, twins[1].views(0, rows))
            np.testing.assert_array_equal(got, want)
            for buffers in twins:
                buffers.lengths[:rows] = (lengths + 1).tolist()
        assert graphed.graphs == 2  # one binding for 3 rows, one for 2
        for past, array in twins[0].arrays.items():
            np.testing.assert_array_equal(array, twins[1].arrays[past])
        twins[0].fit(65)  # replaced by buffers twice as long, the cache copied
        assert twins[0].rows == 128
        got = graphed.step(embeds, lengths + 1, twins[0].views(0, 2))
        assert graphed.graphs == 1  # the old buffers' bindings released
        np.testing.assert_array_equal(got, lm.extend_rows(embeds, lengths + 1, twins[1].views(0, 2)))


def test_the_steps_that_may_capture_hold_the_gpu_alone(fp16_decode_bundle: Path) -> None:
    """A shape's first `CAPTURE_RUNS` steps, where onnxruntime captures its graph, wait for the GPU's uses
    in flight (`capture_gate.GATE`); the replays after them do not. On the CPU, the runner taken for one that
    captures (what the gate sees of it: `cuda_graph`)."""
    bundle = RuntimeBundle.open(fp16_decode_bundle)
    with Synthesizer(bundle, threads=1) as synth:
        lm = synth.lm
        assert lm.in_place is not None
        lm.in_place.cuda_graph = True
        graphed = GraphedSteps(lm.in_place)
        buffers = SlotBuffers(lm.spec, 2, 64, lm.max_positions)
        _fill(buffers, [5, 9], seed=0)
        width = lm.speech_embedding.shape[1]

        def hold(holding: threading.Event, release: threading.Event) -> None:
            with GATE.use():
                holding.set()
                release.wait(5)

        def steps_while_the_gpu_is_used(rows: int, count: int) -> list[bool]:
            """For each of `count` steps of `rows` rows: whether it waited for another thread's use."""
            waited = []
            for _ in range(count):
                holding, release = threading.Event(), threading.Event()
                user = threading.Thread(target=hold, args=(holding, release))
                user.start()
                assert holding.wait(5)
                timer = threading.Timer(0.3, release.set)
                timer.start()
                started = time.perf_counter()
                graphed.step(np.ones((rows, 1, width), np.float32), np.array(buffers.lengths[:rows]),
                             buffers.views(0, rows))
                waited.append(time.perf_counter() - started >= 0.25)
                release.set()
                user.join()
                timer.join()
            return waited

        assert steps_while_the_gpu_is_used(2, CAPTURE_RUNS + 2) == [True] * CAPTURE_RUNS + [False] * 2
        assert steps_while_the_gpu_is_used(1, CAPTURE_RUNS + 1) == [True] * CAPTURE_RUNS + [False]
        graphed.release()


def test_cuda_graphs_are_refused_where_they_cannot_run(fp16_decode_bundle: Path, runtime_bundle: Path
                                                      ) -> None:
    """On the CPU, or where the decode steps do not run on `llm_decode`: one line naming the fix, before any
    graph opens; a runner's CUDA graphs only on cuda; the bound steps only on `llm_decode`."""
    fp16 = RuntimeBundle.open(fp16_decode_bundle)
    with pytest.raises(UserError, match=r"^cuda graphs are the cuda provider's, not 'cpu''s$"):
        Synthesizer(fp16, cuda_graphs=True)
    plain = RuntimeBundle.open(runtime_bundle)
    with pytest.raises(UserError, match=r"^cuda graphs: the decode steps replay from CUDA graphs on "
                                        r"llm_decode; .* \(fp32\) decodes on llm on cuda \(export "
                                        r"--precision decode=fp16 or gpu-fp16\)$"):
        Synthesizer(plain, CUDA, cuda_graphs=True)
    with pytest.raises(ValueError, match=r"^CUDA graphs are an option of the cuda provider, not 'cpu'$"):
        OrtRunner(fp16.graph_path("llm_decode"), fp16.specs["llm_decode"], CPU, cuda_graph=True)
    llm = OrtRunner(plain.graph_path("llm"), plain.specs["llm"], CPU)
    with llm, pytest.raises(ValueError, match=r"^steps replayed from CUDA graphs run on llm_decode, not "
                                              r"llm$"):
        GraphedSteps(llm)
    assert llm.run_options is None  # no CUDA graphs: the runner's calls as they are


def test_unasked_cuda_graphs_are_used_wherever_they_can_run(fp16_decode_bundle: Path, runtime_bundle: Path
                                                            ) -> None:
    """Not asked either way, the decode steps replay from CUDA graphs on cuda where they run on `llm_decode`,
    and nowhere else; asked not to, nowhere."""
    fp16, plain = RuntimeBundle.open(fp16_decode_bundle), RuntimeBundle.open(runtime_bundle)
    assert uses_cuda_graphs(None, fp16, CUDA) is True
    assert uses_cuda_graphs(None, fp16, CPU) is False and uses_cuda_graphs(None, plain, CUDA) is False
    assert uses_cuda_graphs(False, fp16, CUDA) is False and uses_cuda_graphs(True, fp16, CUDA) is True
    with Synthesizer(fp16) as synth:  # the CPU: the steps as they are, no batch
        assert synth.graphs is None and synth.batcher is None


@needs_cuda
def test_on_cuda_the_session_takes_cuda_graphs_and_its_own_calls_run_outside_them(fp16_decode_bundle: Path
                                                                                  ) -> None:
    """On a GPU onnxruntime makes the session with CUDA graphs (it refuses one where a node copies between
    host and device), the prefill runs outside the graphs, and a decoding's steps go through one binding (one
    row); the replayed steps' log-probs against plain ones: tests/test_decode_batch.py."""
    bundle = RuntimeBundle.open(fp16_decode_bundle)
    request = LlmRequest(text_ids=(*range(5, 25), bundle.endofprompt_id),
                         prompt_speech_tokens=tuple(range(40)))
    with Synthesizer(bundle, CUDA, cuda_graphs=True) as synth:
        runner = synth.lm.in_place
        assert runner is not None and runner.run_options is not None
        assert runner.run_options.get_run_config_entry(GPU_GRAPH_ID) == SKIP_GRAPH
        decoding = synth.decode(request, GreedySampler(), max_tokens=80, ignore_stop=True)
        assert list(decoding) and synth.graphs is not None and synth.graphs.graphs == 1


@needs_cuda
def test_on_cuda_steps_are_captured_while_other_threads_call_the_gpu(fp16_decode_bundle: Path,
                                                                     prompt: PromptFeatures) -> None:
    """onnxruntime captures a CUDA graph in CUDA's global capture mode, where a synchronising call of another
    thread may fail while the capture runs (onnxruntime 1.31 supports its graphs on a single thread). The
    runtime captures a decode step of each new row count, and again after its buffers grow, on the batch's
    thread while other streams' flow and vocoder run on theirs, holding the GPU alone meanwhile
    (`capture_gate`). Here steps of 1 to 4 rows over two allocations (eight captures) while another thread
    synthesises tokens over and over: neither fails, and the replayed steps' log-probs stay those of steps
    launched node by node."""
    bundle = RuntimeBundle.open(fp16_decode_bundle)
    with Synthesizer(bundle, CUDA, cuda_graphs=True) as synth:
        lm = synth.lm
        assert lm.in_place is not None
        graphed = GraphedSteps(lm.in_place)
        done, failures, rounds = threading.Event(), [], [0]

        def speak() -> None:
            try:
                while not done.is_set():
                    synth.token2wav(list(range(60)), prompt)
                    rounds[0] += 1
            except Exception as e:  # reported by the main thread
                failures.append(e)

        speaker = threading.Thread(target=speak)
        speaker.start()
        rng = np.random.default_rng(0)
        width = lm.speech_embedding.shape[1]
        try:
            for length in (64, 128):
                ours, plain = (SlotBuffers(lm.spec, 4, length, lm.max_positions, CUDA) for _ in range(2))
                for rows in (1, 2, 3, 4):
                    for step in range(4):  # two calls before onnxruntime captures, the capture, a replay
                        embeds = rng.uniform(-1, 1, (rows, 1, width)).astype(np.float32)
                        lengths = np.full(rows, 5 + step, dtype=np.int64)
                        got = graphed.step(embeds, lengths, ours.views(0, rows))
                        want = lm.extend_rows(embeds, lengths, plain.views(0, rows))
                        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        finally:
            done.set()
            speaker.join()
            graphed.release()
        assert not failures, failures
        assert rounds[0] > 0
