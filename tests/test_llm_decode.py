"""`llm_decode`: the LLM's decode body for onnxruntime's CPU, its caches in buffers written in place
(`GroupQueryAttention`), exported where a plan names it (`cpu-fast` does), validated and gated as `llm` is,
and run by the runtime on the CPU in place of `llm`: the same log-probs and ids, nothing grown per step."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import onnx
import onnxruntime as ort
from click.testing import CliRunner

from cosyvoice_bench.graph_profile import in_place_call
from cosyvoice_bench.graph_profile import main as profile_main
from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.bundle.tiny import config_for_size
from cosyvoice_export.cli import main
from cosyvoice_export.onnx.dims import model_dims
from cosyvoice_export.onnx.trace import EXPORTER_VERSION, check_contract, export_graph
from cosyvoice_export.onnx.validate import validate_graph
from cosyvoice_export.onnx.wrappers.llm import LLMDecodeGraph
from cosyvoice_golden.cli import main as golden_main
from cosyvoice_golden.stats import GraphRecorder
from cosyvoice_graphs import (
    SEQLENS_K,
    TOTAL_SEQUENCE_LENGTH,
    cache_pairs,
    decode_lengths,
    decode_step_case,
    empty_caches,
    metadata,
    spec,
)
from cosyvoice_graphs.bundle_layout import MANIFEST
from cosyvoice_graphs.precision_plan import PROFILES
from cosyvoice_runtime.bundle import RuntimeBundle, read_onnx_metadata
from cosyvoice_runtime.errors import UserError
from cosyvoice_runtime.llm import FIRST_BUFFER_STEPS, KVBuffers, LlmRequest, SpeechTokenLM
from cosyvoice_runtime.runners import (
    CPU,
    CUDA,
    OPENVINO,
    TRT,
    BufferView,
    Runner,
    decode_body,
    graphs_run,
    open_runner,
    prefill_body,
)
from cosyvoice_runtime.runners.ort_settings import FORCE_SPINNING_STOP
from cosyvoice_runtime.sampling import GreedySampler
from cosyvoice_runtime.synthesis import Synthesizer, check_max_batch
from cosyvoice_runtime.tuning import opt_case

STEPS = FIRST_BUFFER_STEPS + 44
"""Decode steps of the comparisons: past the buffers' first size, so that they grow once."""


@pytest.fixture(scope="module")
def fast_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runtime") / "tiny-cpu-fast"
    result = CliRunner().invoke(main, ["all", "--model-dir", str(tiny_bundle), "--out", str(out),
                                       "--precision", "cpu-fast"])
    assert result.exit_code == 0, result.output
    assert "llm_decode [int4 decode]" in result.output
    return out


def _request(bundle: RuntimeBundle) -> LlmRequest:
    return LlmRequest(text_ids=(*range(5, 25), bundle.endofprompt_id), prompt_speech_tokens=tuple(range(40)))


def _twin(lm: SpeechTokenLM, runner: Runner, prefill: Runner | None) -> SpeechTokenLM:
    """`lm`'s tables around another body."""
    return SpeechTokenLM(runner, lm.text_embedding, lm.speech_embedding, sos=lm.sos, task_id=lm.task_id,
                         endofprompt_id=lm.endofprompt_id, speech_token_size=lm.speech_token_size,
                         prefill=prefill)


def test_the_profile_names_the_decode_body() -> None:
    assert PROFILES["cpu-fast"]["llm_decode"] == "int4"


def test_the_float32_graph_is_the_torch_llm(tiny_bundle: Path, tmp_path: Path) -> None:
    """onnxruntime's `GroupQueryAttention` against our torch attention (upstream's), within `llm`'s float32
    bounds at every case of the spec, and the RoPE table's length in the metadata."""
    bundle = ModelBundle.open(tiny_bundle)
    wrapper = LLMDecodeGraph(bundle.load_network("llm"))  # type: ignore[arg-type]
    dims = model_dims(bundle.config)
    s = spec("llm_decode", dims)
    result = export_graph(wrapper, s, dims, tmp_path / "llm_decode.onnx")
    positions = bundle.config.llm.qwen.max_position_embeddings
    assert read_onnx_metadata(result.path) == metadata(s, dims, {"exporter_version": EXPORTER_VERSION,
                                                                 "max_positions": positions})
    validation = validate_graph(result.path, wrapper, s)
    validation.raise_for_failure()
    assert {f.output for f in validation.figures} == set(s.output_names)
    assert max(f.measured for f in validation.figures) < 1e-4


def test_the_graph_is_llm_with_one_attention_operator_per_layer(fast_bundle: Path) -> None:
    manifest = json.loads((fast_bundle / MANIFEST).read_text())
    entry = manifest["graphs"]["llm_decode"]
    assert entry["precision"] == "int4" and entry["validation"]["passed"]
    gates = entry["validation"]["gates"]
    dims = model_dims(config_for_size("tiny"))
    assert {m: g["bound"] for m, g in gates.items()} == spec("llm_decode", dims).decode_gates["int4"].bounds()
    # the same weights as `llm`, so its figures against the torch reference, up to float32 rounding
    llm_gates = manifest["graphs"]["llm"]["validation"]["gates"]
    assert {m: g["passed"] for m, g in gates.items()} == {m: g["passed"] for m, g in llm_gates.items()}
    for metric, gate in gates.items():
        assert gate["measured"] == pytest.approx(llm_gates[metric]["measured"], rel=1e-2), metric
    model = onnx.load(str(fast_bundle / entry["file"]))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("GroupQueryAttention") == dims.llm_layers
    assert ops.count("MatMulNBits") == 4 * dims.llm_layers  # q|k|v, o, gate|up, down
    assert "Concat" not in ops and "Softmax" not in ops  # the caches are not grown, attention is one node
    assert {o.domain: o.version for o in model.opset_import}["com.microsoft"] == 1
    meta = read_onnx_metadata(fast_bundle / entry["file"])
    assert meta["spec_name"] == "llm_decode"
    assert int(meta["max_positions"]) == config_for_size("tiny").llm.qwen.max_position_embeddings


def test_the_cpu_runs_decode_steps_on_it_and_other_providers_on_llm(fast_bundle: Path) -> None:
    bundle = RuntimeBundle.open(fast_bundle)
    everything = set(bundle.specs)
    assert set(graphs_run(bundle, CPU)) == everything - {"llm"}
    for provider in (CUDA, TRT, OPENVINO):
        assert set(graphs_run(bundle, provider)) == everything - {"llm_decode"}
    with Synthesizer(bundle, threads=1) as synth:
        assert "llm" not in synth.runners and synth.lm.runner is synth.runners["llm_decode"]
        assert synth.lm.prefill is synth.runners["llm_prefill"]
        # called back to back, like `llm`'s decode steps: its workers keep spinning between calls
        options = synth.lm.runner.session.get_session_options()  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError):  # the entry is not set
            options.get_session_config_entry(FORCE_SPINNING_STOP)


def test_decoding_in_place_gives_llms_ids_and_log_probs(fast_bundle: Path) -> None:
    """Greedy decoding on `llm_decode` (prefill on `llm_prefill`, then in place) against `llm` (caches
    grown): the same ids over a run long enough to grow the buffers, log-probs within float32 rounding."""
    bundle = RuntimeBundle.open(fast_bundle)
    with Synthesizer(bundle, threads=1) as synth, open_runner(bundle, "llm", threads=1) as llm:
        lm = synth.lm
        grown = _twin(lm, llm, lm.prefill)
        request = _request(bundle)
        decodings = [m.decode(request, GreedySampler(), max_tokens=STEPS, ignore_stop=True)
                     for m in (lm, grown)]
        in_place, reference = (d.run() for d in decodings)
        assert in_place == reference and len(in_place) > FIRST_BUFFER_STEPS
        buffers = decodings[0].cache
        assert isinstance(buffers, KVBuffers)
        prefill = lm.prompt_embeds(request).shape[1]
        assert buffers.length == prefill + STEPS - 1  # the last id is never fed back
        assert buffers.rows == 2 * (prefill + FIRST_BUFFER_STEPS)  # grown once, by doubling
        # the cache in the buffers is the one `llm` grew, row for row
        grown_cache = decodings[1].cache
        assert isinstance(grown_cache, dict)
        for past, array in buffers.arrays.items():
            want = grown_cache[past]
            want = want.numpy() if isinstance(want, ort.OrtValue) else want
            np.testing.assert_allclose(array[:, :, :buffers.length], want, rtol=0, atol=1e-4)

        embeds = lm.prompt_embeds(request)
        caches = [lm.empty_cache(embeds.shape[1]), grown.empty_cache()]
        worst = 0.0
        for _ in range(30):
            (a, caches[0]), (b, caches[1]) = lm.step(embeds, caches[0]), grown.step(embeds, caches[1])
            worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
            embeds = lm.speech_embedding[[int(np.argmax(b[:lm.speech_token_size]))]][None]
        assert worst < 1e-5


def test_the_writes_are_in_place(fast_bundle: Path) -> None:
    """A decode step writes its row into the bound buffers and allocates none: the buffers keep their
    memory; without a prefill body the prompt is prefilled into them too."""
    bundle = RuntimeBundle.open(fast_bundle)
    with Synthesizer(bundle, threads=1) as synth:
        lm = _twin(synth.lm, synth.lm.runner, None)
        embeds = lm.prompt_embeds(_request(bundle))
        cache = lm.empty_cache(embeds.shape[1])
        assert isinstance(cache, KVBuffers) and cache.length == 0
        pointers = {past: value.data_ptr() for past, value in cache.values.items()}
        _, cache = lm.step(embeds, cache)  # the prefill, on llm_decode itself
        _, cache = lm.step(lm.speech_embedding[[3]][None], cache)
        assert isinstance(cache, KVBuffers) and cache.length == embeds.shape[1] + 1
        assert {past: value.data_ptr() for past, value in cache.values.items()} == pointers
        assert all(np.abs(a[:, :, :cache.length]).max() > 0 for a in cache.arrays.values())
        assert all(not a[:, :, cache.length:].any() for a in cache.arrays.values())


def test_in_place_equals_the_graph_grown_on_its_own_cases(fast_bundle: Path) -> None:
    """The same graph, fed buffers of exactly the cache (its validation cases) or longer ones bound as
    outputs: the same log-probs, bit for bit, and the same rows."""
    bundle = RuntimeBundle.open(fast_bundle)
    with open_runner(bundle, "llm_decode", threads=1) as runner:
        s = runner.spec
        rng = np.random.default_rng(0)
        past_len, new_len, rows = 9, 3, 20
        feeds = s.sample_inputs(s.validate[0])
        embeds = rng.uniform(-1, 1, (1, new_len, feeds["inputs_embeds"].shape[2])).astype(np.float32)
        caches = {p: rng.uniform(-1, 1, (*v.shape[:2], past_len, v.shape[3])).astype(np.float32)
                  for p, v in empty_caches(s).items()}
        at = {"inputs_embeds": embeds, **decode_lengths([past_len], new_len)}
        grown = runner.infer({**at, **caches})
        buffers = KVBuffers(s, rows, rows)
        buffers.fill(caches)
        assert buffers.length == past_len
        in_place = {present: past for past, present in cache_pairs(s)}
        out = runner.infer_in_place({**at, **buffers.values}, in_place, ["logp"])
        np.testing.assert_array_equal(out["logp"], grown["logp"])
        for past, present in cache_pairs(s):
            np.testing.assert_array_equal(buffers.arrays[past][:, :, :past_len + new_len], grown[present])
        with pytest.raises(ValueError, match=r"llm_decode.past_key_0: an output written in place needs its "
                                             r"input as an OrtValue or a BufferView on cpu"):
            runner.infer_in_place({**at, **buffers.arrays}, {"present_key_0": "past_key_0"}, ["logp"])
        # the cache in row 1 of three, bound by its address: that row written, the others untouched
        batch = {p: np.full((3, a.shape[1], rows, a.shape[3]), 7, dtype=a.dtype) for p, a in caches.items()}
        for past, array in batch.items():
            array[1, :, :past_len] = caches[past][0]
        values = {past: ort.OrtValue.ortvalue_from_numpy(a) for past, a in batch.items()}
        views = {past: BufferView(v, 1, 1) for past, v in values.items()}
        assert views["past_key_0"].shape == (1, *batch["past_key_0"].shape[1:])
        assert views["past_key_0"].address == values["past_key_0"].data_ptr() + batch["past_key_0"][0].nbytes
        out = runner.infer_in_place({**at, **views}, in_place, ["logp"])
        np.testing.assert_array_equal(out["logp"], grown["logp"])
        for past, present in cache_pairs(s):
            np.testing.assert_array_equal(batch[past][1:2, :, :past_len + new_len], grown[present])
            assert (batch[past][[0, 2]] == 7).all() and (batch[past][1, :, past_len + new_len:] == 7).all()
        with pytest.raises(ValueError, match="a view of 2 rows from row 2 of a tensor of 3 rows"):
            BufferView(values["past_key_0"], 2, 2)


@pytest.mark.parametrize(("cache_len", "new_len"), [([9, 17, 4], 1), ([9], 5), ([0], 6)])
def test_any_total_up_to_the_buffers_length_gives_the_same_rows(fast_bundle: Path, cache_len: list[int],
                                                                new_len: int) -> None:
    """`total_sequence_length` at the longest row's total, or at the buffers' length (what a CUDA graph's
    replays keep): the same log-probs and the same cache rows, bit for bit, for decode steps of a batch and
    for a prefill (one row, as onnxruntime's CPU attention takes many new positions); below the longest,
    refused."""
    bundle = RuntimeBundle.open(fast_bundle)
    with open_runner(bundle, "llm_decode", threads=1) as runner:
        s = runner.spec
        rng = np.random.default_rng(1)
        rows = 40
        base = {p: rng.uniform(-1, 1, (len(cache_len), v.shape[1], rows, v.shape[3])).astype(np.float32)
                for p, v in empty_caches(s).items()}
        embeds = rng.uniform(-1, 1, (len(cache_len), new_len, s.inputs[0].shape[2])).astype(np.float32)
        in_place = {present: past for past, present in cache_pairs(s)}
        results = []
        for total in (None, rows):
            buffers = {p: a.copy() for p, a in base.items()}
            feeds = {"inputs_embeds": embeds, **decode_lengths(cache_len, new_len, total),
                     **{p: ort.OrtValue.ortvalue_from_numpy(a) for p, a in buffers.items()}}
            results.append((runner.infer_in_place(feeds, in_place, ["logp"])["logp"], buffers))
        (logp, written), (logp_rows, written_rows) = results
        np.testing.assert_array_equal(logp_rows, logp)
        for past, array in written.items():
            for row, length in enumerate(cache_len):
                np.testing.assert_array_equal(written_rows[past][row, :, :length + new_len],
                                              array[row, :, :length + new_len])
                assert not np.array_equal(array[row, :, length:length + new_len],
                                          base[past][row, :, length:length + new_len])  # written
    with pytest.raises(ValueError, match=r"^total_sequence_length 17 is below the longest row's 18 "
                                         r"positions$"):
        decode_lengths([9, 17, 4], 1, 17)


def test_the_lengths_reach_the_attention_as_they_are(fast_bundle: Path) -> None:
    """No node computes on the lengths or on shapes: onnxruntime's CUDA provider would run such nodes on the
    host and copy between host and device, and refuse to capture the step in a CUDA graph."""
    model = onnx.load(str(fast_bundle / "graphs" / "llm_decode.onnx"), load_external_data=False)
    names = (SEQLENS_K, TOTAL_SEQUENCE_LENGTH)
    readers = {n.op_type for n in model.graph.node for i in n.input if i in names}
    assert readers == {"GroupQueryAttention"}
    assert not {"Shape", "Size", "ReduceMax", "Cast"} & {n.op_type for n in model.graph.node}
    lengths = decode_lengths(np.array([3, 0, 7]), 2)
    assert lengths[SEQLENS_K].dtype == np.int32 and lengths[SEQLENS_K].tolist() == [4, 1, 8]
    assert lengths[TOTAL_SEQUENCE_LENGTH].shape == () and int(lengths[TOTAL_SEQUENCE_LENGTH]) == 9


def test_tuning_times_the_decode_body_at_a_full_cache(fast_bundle: Path) -> None:
    s = RuntimeBundle.open(fast_bundle).specs["llm_decode"]
    case = opt_case(s)
    full = s.dims["past_len"].opt
    assert case.dims == {"batch": 1, "new_len": 1, "past_len": full}
    assert case.values == {SEQLENS_K: (full,), TOTAL_SEQUENCE_LENGTH: (full + 1,)}


def test_positions_past_the_rope_table_are_refused(fast_bundle: Path) -> None:
    s = RuntimeBundle.open(fast_bundle).specs["llm_decode"]
    buffers = KVBuffers(s, 8, 12)
    buffers.reserve(12)
    assert buffers.rows == 12  # doubling stops at the table's end
    with pytest.raises(ValueError, match=r"^llm_decode: 13 positions, but its RoPE table ends at 12$"):
        buffers.reserve(13)


def test_golden_checks_the_graphs_the_pipeline_runs(fp16_decode_bundle: Path) -> None:
    """Where `llm_decode` and the prefill body take every `llm` call, golden does not judge `llm`'s graph
    (on CUDA an fp16 `llm` would not even run) and says so."""
    done = CliRunner().invoke(golden_main, ["check", "--model", str(fp16_decode_bundle), "--graph", "llm",
                                            "--graph", "hift_f0"])
    assert done.exit_code == 0, done.output
    assert re.search(r"^- graph llm +not checked: the pipeline does not run it on cpu$", done.output, re.M)
    assert "✓ graph hift_f0" in done.output and "1 of 1 passed" in done.output


def test_golden_statistics_see_the_steps_in_place(fast_bundle: Path) -> None:
    bundle = RuntimeBundle.open(fast_bundle)
    with Synthesizer(bundle, threads=1) as synth:
        recorder = GraphRecorder(synth)
        with recorder.record() as stats:
            synth.lm.decode(_request(bundle), GreedySampler(), max_tokens=5, ignore_stop=True).run()
        assert stats.calls == {"llm_prefill": 1, "llm_decode": 4}
        assert set(stats.outputs["llm_decode"]) == {"logp"}


def test_the_profile_runs_a_batched_decode_step_in_place(fast_bundle: Path, tmp_path: Path) -> None:
    """`graph_profile --decode-rows 3` profiles one `llm_decode` step of three decodings, each with room for
    its new position, whose keys and values are written into the bound buffers as the runtime's are."""
    out = tmp_path / "profile.json"
    args = ["--model", str(fast_bundle), "--calls", "2", "--decode-rows", "3", "--decode-past", "20"]
    done = CliRunner().invoke(profile_main, [*args, "--json", str(out)])
    assert done.exit_code == 0, done.output
    decode = json.loads(out.read_text())["profiles"][0]
    assert decode["graph"] == "llm_decode" and decode["shape"] == {"batch": 3, "new_len": 1, "past_len": 21}
    assert "llm_decode (int4, batch=3, new_len=1, past_len=21)" in done.output

    bundle = RuntimeBundle.open(fast_bundle)
    s = bundle.specs["llm_decode"]
    feeds = s.sample_inputs(decode_step_case(s, 20, batch=3, room=1))
    for past, _ in cache_pairs(s):
        feeds[past][:, :, 20] = 0  # the row the step writes
    session = ort.InferenceSession(str(bundle.graph_path("llm_decode")), providers=["CPUExecutionProvider"])
    before = {past: feeds[past].copy() for past, _ in cache_pairs(s)}
    in_place_call(session, s, feeds)()
    for past, _ in cache_pairs(s):  # the buffers wrap the feeds' memory: the new rows are there
        assert np.abs(feeds[past][:, :, 20]).min() > 0
        np.testing.assert_array_equal(feeds[past][:, :, :20], before[past][:, :, :20])


def test_the_fp16_body_keeps_its_caches_in_float16_buffers(fp16_decode_bundle: Path) -> None:
    """CUDA's `GroupQueryAttention` computes in float16 only: the fp16 body's caches are float16 I/O, which
    the attention reads and writes itself (no Cast copies them), and the rest of its I/O is float32."""
    manifest = json.loads((fp16_decode_bundle / MANIFEST).read_text())
    entry = manifest["graphs"]["llm_decode"]
    dims = model_dims(config_for_size("tiny"))
    s = spec("llm_decode", dims)
    assert entry["precision"] == "fp16" and entry["validation"]["passed"]
    for output, figure in entry["validation"]["outputs"].items():
        assert (figure["metric"], figure["bound"]) == (s.precision_tolerances["fp16"][output].metric,
                                                        s.precision_tolerances["fp16"][output].bound)
    model = onnx.load(str(fp16_decode_bundle / entry["file"]))
    check_contract(model, s.io_at("fp16"))
    half, single = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    io = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
    caches = {name for pair in cache_pairs(s) for name in pair}
    assert {n for n, t in io.items() if t == half} == caches
    assert io["inputs_embeds"] == io["logp"] == single
    attention = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == dims.llm_layers
    assert {n.name.rsplit("/", 1)[0] for n in attention} == {f"/model/layers.{i}/self_attn"
                                                              for i in range(dims.llm_layers)}
    writers = {out: n for n in model.graph.node for out in n.output}
    for past, present in cache_pairs(s):
        assert writers[present].op_type == "GroupQueryAttention"
        assert all(n.op_type != "Cast" for n in model.graph.node if past in n.input)
    tables = {t.name: t.data_type for t in model.graph.initializer}
    assert all(tables[n.input[7]] == tables[n.input[8]] == half for n in attention)  # RoPE's cos and sin


def test_cuda_decodes_on_the_fp16_body_in_buffers_of_its_own(fp16_decode_bundle: Path, fast_bundle: Path
                                                              ) -> None:
    """Where the CUDA provider takes the decode steps (an fp16 `llm_decode`), the prefill runs on it too,
    into the buffers on the GPU, and neither `llm` nor the prefill body opens; it batches there (an int4
    bundle, which decodes on `llm` there, does not)."""
    bundle = RuntimeBundle.open(fp16_decode_bundle)
    everything = set(bundle.specs)
    assert (decode_body(bundle, CUDA), prefill_body(bundle, CUDA)) == ("llm_decode", None)
    assert set(graphs_run(bundle, CUDA)) == everything - {"llm", "llm_prefill"}
    assert (decode_body(bundle, CPU), prefill_body(bundle, CPU)) == ("llm_decode", "llm_prefill")
    assert set(graphs_run(bundle, CPU)) == everything - {"llm"}
    assert bundle.specs["llm_decode"].inputs[3].dtype == "float16"  # the bundle's spec is its body's
    fast = RuntimeBundle.open(fast_bundle)  # int4: not on CUDA, whose kernel has no int4 attention
    assert (decode_body(fast, CUDA), prefill_body(fast, CUDA)) == ("llm", "llm_prefill")
    with pytest.raises(UserError, match=r"max_batch 2: batched decoding runs on llm_decode, on the cpu "
                                        r"provider or in fp16 on cuda; .* on 'cuda' decodes on llm "):
        check_max_batch(2, fast, CUDA)
    check_max_batch(2, bundle, CUDA)
    check_max_batch(2, bundle, CPU)
    with Synthesizer(bundle, threads=1) as synth:  # on the CPU the int8 prefill fills the float16 buffers
        decoding = synth.lm.decode(_request(bundle), GreedySampler(), max_tokens=5, ignore_stop=True)
        assert len(decoding.run()) == 5
        buffers = decoding.cache
        assert isinstance(buffers, KVBuffers) and buffers.length == synth.lm.prompt_embeds(
            _request(bundle)).shape[1] + 4
        assert all(np.abs(a[:, :, :buffers.length]).max() > 0 and a.dtype == np.float16
                   for a in buffers.arrays.values())


@pytest.mark.parametrize("provider", [CPU, CUDA])
def test_the_fp16_body_decodes_in_place_close_to_llm(fp16_decode_bundle: Path, provider: str) -> None:
    """On the GPU as on the CPU (where the code is the same, in the CPU's memory): prefilled on `llm_decode`
    itself, float16 buffers on the device that the steps write in place and that grow past their first size,
    the log-probs within the fp16 bounds of float32 `llm`'s on the CPU, teacher-forced over the run."""
    if provider == CUDA and "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime's CUDA provider (onnxruntime-gpu and a GPU)")
    bundle = RuntimeBundle.open(fp16_decode_bundle)
    with (Synthesizer(bundle, provider=provider, threads=1) as synth,
          open_runner(bundle, "llm", threads=1) as llm):
        lm = synth.lm
        assert lm.prefill is None if provider == CUDA else lm.prefill is synth.runners["llm_prefill"]
        lm = _twin(lm, lm.runner, None)
        grown = _twin(lm, llm, None)
        embeds = lm.prompt_embeds(_request(bundle))
        prompt = embeds.shape[1]
        caches = [lm.empty_cache(prompt), grown.empty_cache()]
        buffers = caches[0]
        assert isinstance(buffers, KVBuffers)
        worst, before = 0.0, (0, {})
        for _ in range(STEPS):
            (a, caches[0]), (b, caches[1]) = lm.step(embeds, caches[0]), grown.step(embeds, caches[1])
            worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
            embeds = lm.speech_embedding[[int(np.argmax(b[:lm.speech_token_size]))]][None]
            now = (buffers.rows, {past: value.data_ptr() for past, value in buffers.values.items()})
            assert now[0] != before[0] or now[1] == before[1]  # written in place until the buffers grow
            before = now
        assert buffers.rows == 2 * (prompt + FIRST_BUFFER_STEPS)  # grown
        assert all(v.device_name().lower() == provider and v.data_type() == "tensor(float16)"
                   for v in buffers.values.values())
        bound = spec("llm_decode", bundle.dims).precision_tolerances["fp16"]["logp"].bound
        assert 0 < worst < bound
