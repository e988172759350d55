"""The runtime's bundle loader and runners, on the tiny runtime bundle (CPU only)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from cosyvoice_graphs import SPECS, cache_pairs, empty_caches
from cosyvoice_graphs.bundle_layout import FORMAT_VERSION, MANIFEST, SPEECH_EMBEDDING
from cosyvoice_graphs.manifest import Manifest
from cosyvoice_runtime.bundle import RuntimeBundle, TrtPlan
from cosyvoice_runtime.errors import FeedError, ProviderError, RuntimeBundleError
from cosyvoice_runtime.runners import OrtRunner, Runner, RunnerBase, TrtRunner, open_runner
from cosyvoice_runtime.runners import ort as ort_runner


@pytest.fixture(scope="module")
def bundle(runtime_bundle: Path) -> RuntimeBundle:
    return RuntimeBundle.open(runtime_bundle)


def clone(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """`src` as links to its files (cheap: the sine table alone is 50 MB) with a copied, edited manifest."""
    for path in src.rglob("*"):
        if path.is_file() and path.name != MANIFEST:
            (dst / path.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (dst / path.relative_to(src)).symlink_to(path)
    manifest = json.loads((src / MANIFEST).read_text())
    if edit is not None:
        edit(manifest)
    (dst / MANIFEST).write_text(json.dumps(manifest))
    return dst


def one_line_error(root: Path, match: str, verify: bool = False) -> RuntimeBundleError:
    with pytest.raises(RuntimeBundleError, match=match) as info:
        RuntimeBundle.open(root, verify=verify)
    assert "\n" not in str(info.value)
    return info.value


# --- the bundle ------------------------------------------------------------------------------------------

def test_open_and_verify(runtime_bundle: Path) -> None:
    bundle = RuntimeBundle.open(runtime_bundle, verify=True)
    model = json.loads((runtime_bundle / MANIFEST).read_text())["model"]
    assert list(bundle.specs) == list(SPECS)
    assert (bundle.sos, bundle.eos, bundle.task_id, bundle.endofprompt_id) == (
        model["sos"], model["eos"], model["task_id"], model["endofprompt_id"])
    assert bundle.sample_rate == model["sample_rate"] == bundle.dims.sample_rate
    assert bundle.frontend_path("campplus").is_file() and bundle.frontend_path("speech_tokenizer").is_file()
    assert (bundle.tokenizer_dir / "vocab.json").is_file()
    table = bundle.table(SPEECH_EMBEDDING)
    assert table.shape == (bundle.dims.speech_vocab, bundle.dims.llm_hidden) and table.dtype == np.float32
    assert isinstance(table.base, np.memmap) and not table.flags.writeable  # mapped, not read in
    assert type(table[[0]]) is np.ndarray  # a lookup builds no memmap of its own
    for name in SPECS:
        assert bundle.graph_path(name).is_file()
        meta = bundle.graph_metadata(name)
        assert meta["spec_name"] == name and meta["spec_version"] == str(bundle.specs[name].version)
    with pytest.raises(KeyError, match="unknown front-end model"):
        bundle.frontend_path("whisper")
    with pytest.raises(KeyError, match="unknown table"):
        bundle.table("nope")


def test_no_manifest(tmp_path: Path) -> None:
    one_line_error(tmp_path, "manifest.json: missing; not a runtime bundle")
    # no folder at all is named as that, not as a manifest missing from it
    error = one_line_error(tmp_path / "nowhere", "nowhere: does not exist; a runtime bundle is a folder")
    assert MANIFEST not in str(error)


def test_corrupted_manifest(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path)
    (root / MANIFEST).write_text('{"format": "cosyvoice3-runtime-bundle",')
    one_line_error(root, r"manifest.json: not valid JSON \(.* at line 1")


def test_wrong_format_version(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    one_line_error(root, f"format_version is {FORMAT_VERSION + 1}, expected {FORMAT_VERSION}")


def test_missing_model_constant(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path, lambda m: m["model"].pop("eos"))
    one_line_error(root, r"model.eos is missing, expected an integer")


def test_spec_version_mismatch(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path,
                 lambda m: m["graphs"]["flow_estimator_cached"].update(spec_version=99))
    one_line_error(root, r"graphs.flow_estimator_cached is spec 'flow_estimator_cached' version 99, this "
                         r"runtime needs 'flow_estimator_cached' version 5")


def test_unknown_bundle_precision(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path, lambda m: m.update(precision="fp8"))
    one_line_error(root, r"precision is 'fp8', no precision, profile or graph=precision list the exporter "
                         r"writes")


def test_missing_graph_entry(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path, lambda m: m["graphs"].pop("hift_f0"))
    one_line_error(root, r"graphs are \[.*\], expected \[.*'hift_f0'.*\]")


def test_unknown_graph_entry(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path, lambda m: m["graphs"].update(vocoder=m["graphs"]["hift_f0"]))
    one_line_error(root, r"graphs are \[.*'vocoder'\], expected \[.*\]")


def test_missing_file(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path)
    (root / "graphs" / "hift_f0.onnx").unlink()
    one_line_error(root, r"graphs/hift_f0.onnx: missing \(listed in manifest.json\)")


def test_unreadable_file(runtime_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle exported under umask 077 and shared: a file mode 600, a folder mode 700 (faked: root reads
    anything)."""
    root = clone(runtime_bundle, tmp_path)
    llm, graphs = root / "graphs" / "llm.onnx", root / "graphs"
    access, is_file = os.access, Path.is_file
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != llm and access(path, mode, **kw))
    one_line_error(root, r"graphs/llm.onnx: cannot be read \(permission denied\)$")
    monkeypatch.setattr(os, "access", access)

    def denied(path: Path) -> bool:
        if path.parent == graphs:
            raise PermissionError(13, "Permission denied", str(path))
        return is_file(path)

    monkeypatch.setattr(Path, "is_file", denied)
    one_line_error(root, r"graphs/\w+.onnx: cannot be read \(permission denied\)")


def test_unlisted_file(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path, lambda m: m["files"].pop("graphs/llm.onnx"))
    one_line_error(root, "graphs/llm.onnx is used but not listed in files")


def test_path_outside_bundle(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path, lambda m: m["frontend"].update(campplus="../campplus.onnx"))
    one_line_error(root, r"frontend.campplus is '../campplus.onnx', expected a path inside the bundle")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m["graphs"]["llm"]["validation"].update(passed="yes"),
     "graphs.llm.validation.passed is 'yes', expected true or false"),
    (lambda m: m["files"].update({"graphs/llm.onnx": 5}), "files.graphs/llm.onnx is 5, expected an object"),
    (lambda m: m["tables"]["flow_noise"].update(shape=[1, "80"]),
     r"tables.flow_noise.shape is \[1, '80'\], expected a list of integers"),
    (lambda m: m.update(prompt=[]), r"prompt is \[\], expected an object"),
    (lambda m: m["model"].pop("hift"), "model.hift is missing, expected an object"),
    (lambda m: m["model"]["hift"].update(istft_hop_len=3),
     "model.hift gives 360 samples per frame, model.samples_per_frame is 480"),
], ids=["flag", "file entry", "shape", "section", "no hift layout", "hift layout"])
def test_a_manifest_key_of_the_wrong_type_is_named(
        runtime_bundle: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None], message: str) -> None:
    one_line_error(clone(runtime_bundle, tmp_path, edit), message)


def test_the_manifest_reads_back_to_the_bytes_written(runtime_bundle: Path) -> None:
    text = (runtime_bundle / MANIFEST).read_text(encoding="utf-8")
    manifest = Manifest.from_json(json.loads(text), str(runtime_bundle / MANIFEST))
    assert json.dumps(manifest.to_json(), indent=2, ensure_ascii=False) + "\n" == text


def test_sha_mismatch_needs_verify(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path)
    config = root / "tokenizer" / "config.json"
    data = bytearray(config.read_bytes())
    data[-2] ^= 1  # same size: only the hash can tell
    config.unlink()
    config.write_bytes(bytes(data))
    RuntimeBundle.open(root)  # sizes only
    one_line_error(root, r"tokenizer/config.json: sha256 [0-9a-f]{16}…, the manifest says", verify=True)


def test_of_two_damaged_files_verify_names_the_first_listed(runtime_bundle: Path, tmp_path: Path) -> None:
    """Files are hashed several at a time, largest first; the one named is the manifest's first, as hashing
    one after another would name it."""
    root = clone(runtime_bundle, tmp_path)
    files = json.loads((root / MANIFEST).read_text())["files"]
    by_size = sorted(files, key=lambda rel: files[rel]["size"])
    first_listed, largest = next(iter(files)), by_size[-1]
    assert first_listed != largest
    for rel in (first_listed, largest):
        data = bytearray((root / rel).read_bytes())
        data[len(data) // 2] ^= 1
        (root / rel).unlink()
        (root / rel).write_bytes(bytes(data))
    one_line_error(root, rf"^{re.escape(str(root / first_listed))}: sha256 [0-9a-f]{{16}}…", verify=True)


def test_size_mismatch(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path)
    (root / "cosyvoice3.yaml").unlink()
    (root / "cosyvoice3.yaml").write_text("x")
    one_line_error(root, r"cosyvoice3.yaml: 1 bytes, the manifest says \d+")


def test_graph_metadata_checked_against_manifest(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path, lambda m: m["model"].update(sample_rate=22050))
    bundle = RuntimeBundle.open(root)  # metadata is read on request, not at open
    with pytest.raises(RuntimeBundleError, match=r"hift_f0.onnx: metadata sample_rate is '24000', "
                                                 r"the manifest says '22050'"):
        bundle.graph_metadata("hift_f0")
    with pytest.raises(RuntimeBundleError, match="metadata sample_rate"):
        open_runner(bundle, "hift_f0")


def test_not_an_onnx_file(runtime_bundle: Path, tmp_path: Path) -> None:
    root = clone(runtime_bundle, tmp_path)
    graph = root / "graphs" / "hift_f0.onnx"
    size = graph.stat().st_size
    graph.unlink()
    graph.write_bytes(b"\xff" * size)
    with pytest.raises(RuntimeBundleError, match="hift_f0.onnx: not a readable ONNX model"):
        RuntimeBundle.open(root).graph_metadata("hift_f0")


# --- runners ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SPECS))
def test_every_graph_runs_on_cpu(bundle: RuntimeBundle, name: str) -> None:
    spec = bundle.specs[name]
    case = spec.validate[0]
    with open_runner(bundle, name, "cpu", threads=1) as runner:
        assert isinstance(runner, Runner) and runner.spec is spec
        outputs = runner.infer(spec.sample_inputs(case))
    assert list(outputs) == spec.output_names
    for t in spec.outputs:
        assert outputs[t.name].shape == spec.shape_of(t, case.dims), t.name
        assert outputs[t.name].dtype == t.np_dtype, t.name
        assert np.isfinite(outputs[t.name]).all(), t.name
    with pytest.raises(RuntimeError, match="runner is closed"):
        runner.infer(spec.sample_inputs(case))


def test_optimization_levels_agree(bundle: RuntimeBundle) -> None:
    spec = bundle.specs["flow_encoder"]
    feeds = spec.sample_inputs(spec.validate[0])
    path = bundle.graph_path("flow_encoder")
    with OrtRunner(path, spec, optimization="disable") as plain, OrtRunner(path, spec, threads=2) as fast:
        a, b = plain.infer(feeds), fast.infer(feeds)
    for name in spec.output_names:
        np.testing.assert_allclose(a[name], b[name], atol=1e-5)
    with pytest.raises(ValueError, match="unknown optimization level 'max'"):
        OrtRunner(path, spec, optimization="max")


def _feed_error(bundle: RuntimeBundle, graph: str, change: Callable[[dict[str, np.ndarray]], object],
                match: str) -> None:
    spec = bundle.specs[graph]
    feeds = spec.sample_inputs(spec.validate[0])
    change(feeds)
    with open_runner(bundle, graph) as runner, pytest.raises(FeedError, match=match) as info:
        runner.infer(feeds)
    assert "\n" not in str(info.value)


def test_feed_errors(bundle: RuntimeBundle) -> None:
    _feed_error(bundle, "hift_f0", lambda f: f.update(mels=f.pop("mel")), "hift_f0: unknown input 'mels'")
    _feed_error(bundle, "hift_decoder", lambda f: f.pop("phase"), "hift_decoder: missing input 'phase'")
    _feed_error(bundle, "hift_f0", lambda f: f.update(mel=f["mel"].astype(np.float64)),
                r"hift_f0.mel: dtype float64, expected float32")
    _feed_error(bundle, "flow_encoder", lambda f: f.update(tokens=f["tokens"].astype(np.int32)),
                r"flow_encoder.tokens: dtype int32, expected int64")
    _feed_error(bundle, "hift_f0", lambda f: f.update(mel=f["mel"][0]),
                r"hift_f0.mel: shape \(80, 17\) has rank 2, expected \(1, 80, 'frames'\)")
    _feed_error(bundle, "hift_f0", lambda f: f.update(mel=f["mel"][:, :40]),
                r"hift_f0.mel: shape \(1, 40, 17\), dim 1 must be 80")
    _feed_error(bundle, "flow_estimator_cached", lambda f: f.update(mu=f["mu"][..., :-1]),
                r"flow_estimator_cached.mu: new_frames = 122 \(dim 2\), but x has new_frames = 123")
    _feed_error(bundle, "hift_decoder", lambda f: f.update(sine_noise=f["sine_noise"][:, :-1]),
                r"hift_decoder.sine_noise: samples = 5279, expected 5280 for frames = 11")
    _feed_error(bundle, "hift_f0", lambda f: f.update(mel=f["mel"].tolist()),
                "hift_f0.mel: expected a numpy array, got list")


def test_unknown_graph_and_provider(bundle: RuntimeBundle) -> None:
    with pytest.raises(KeyError, match="unknown graph 'vocoder'"):
        open_runner(bundle, "vocoder")
    with pytest.raises(ValueError, match="unknown provider 'gpu'"):
        open_runner(bundle, "hift_f0", "gpu")


@pytest.mark.parametrize(("provider", "ep"), [("cuda", "CUDAExecutionProvider"),
                                              ("tensorrt", "TensorrtExecutionProvider")])
def test_unavailable_provider_is_an_error(bundle: RuntimeBundle, provider: str, ep: str) -> None:
    if ep in ort.get_available_providers():
        pytest.skip(f"{ep} is available here")
    with pytest.raises(ProviderError, match=f"provider '{provider}' needs onnxruntime's {ep}"):
        open_runner(bundle, "hift_f0", provider)


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider' is not in available")
def test_silent_fallback_is_an_error(bundle: RuntimeBundle, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is really available here")
    # claim CUDA is there: onnxruntime then places the whole graph on the CPU, which must not pass
    claimed = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: claimed)
    # the pip packages' CUDA libraries are loaded first, once per process, whatever it prints on stderr
    preloads: list[None] = []
    monkeypatch.setattr(ort, "preload_dlls", lambda: preloads.append(print("loading")), raising=False)
    ort_runner.preload_cuda_libraries.cache_clear()
    for _ in range(2):
        with pytest.raises(ProviderError, match="asked onnxruntime for CUDAExecutionProvider, the session "
                                                "fell back to CPUExecutionProvider; onnxruntime's log above "
                                                r"says why \(CUDA 13 and cuDNN 9 libraries not found\? pip "):
            open_runner(bundle, "hift_f0", "cuda")
    assert len(preloads) == 1
    ort_runner.preload_cuda_libraries.cache_clear()
    out, err = capsys.readouterr()
    assert out == "" and "loading" in err


def test_trt_runner_unavailable(bundle: RuntimeBundle) -> None:
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    plan = TrtPlan(bundle.root / "trt" / "hift_f0.0000000000000000.plan", "10.0.0", "NVIDIA H100")
    with pytest.raises(ProviderError, match=r"provider 'trt' needs TensorRT and polygraphy \(pip uninstall "
                                            r"-y onnxruntime onnxruntime-gpu && pip install "
                                            r"'cosyvoice-onnx\[(export-)?gpu,trt\]'\); tensorrt is not "
                                            r"installed"):
        TrtRunner(plan, bundle.specs["hift_f0"])


def test_openvino_provider_without_openvino(bundle: RuntimeBundle, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` raises ImportError
    with pytest.raises(ProviderError, match=r"OpenVINO runs the 'openvino' provider and every bf16 graph; it "
                                            r"is not installed \(pip install 'cosyvoice-onnx\[openvino\]'\)"):
        open_runner(bundle, "hift_f0", "openvino")


def test_bundle_without_plans(bundle: RuntimeBundle) -> None:
    with pytest.raises(RuntimeBundleError, match=r"graphs.hift_f0 has no TensorRT plan \(export with "
                                                 r"`cosyvoice-export all --trt`"):
        open_runner(bundle, "hift_f0", "trt")


# --- torch-free ------------------------------------------------------------------------------------------

def test_runtime_runs_without_torch(runtime_bundle: Path) -> None:
    script = textwrap.dedent("""
        import sys
        from importlib.abc import MetaPathFinder

        class Refuse(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "cosyvoice_export"):
                    raise ImportError(f"{name} is off limits for the runtime", name=name)
                return None

        sys.meta_path.insert(0, Refuse())
        from cosyvoice_runtime.bundle import RuntimeBundle
        from cosyvoice_runtime.runners import open_runner

        bundle = RuntimeBundle.open(sys.argv[1], verify=True)
        spec = bundle.specs["flow_encoder"]
        with open_runner(bundle, "flow_encoder") as runner:
            out = runner.infer(spec.sample_inputs(spec.validate[0]))
        leaked = [m for m in sys.modules if m.split(".")[0] in ("torch", "cosyvoice_export")]
        assert not leaked, leaked
        print("ok", out["mu"].shape)
    """)
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", script, str(runtime_bundle)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok (1, 80, 74)"


def test_cuda_device_name_is_none_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """No libcuda (this machine, or a CPU-only container): None, which the trt provider turns into a
    one-line error, and which the export's --trt turns into `TrtUnavailable`."""
    import ctypes

    from cosyvoice_runtime.cuda_device import cuda_device_name

    def no_driver(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert cuda_device_name() is None


def test_io_binding_keeps_the_kv_cache_and_equals_plain_runs(runtime_bundle: Path) -> None:
    """`infer_kept` leaves the cache outputs as OrtValues that the next call takes back without a copy;
    outputs equal plain `infer` with numpy caches, step after step."""
    bundle = RuntimeBundle.open(runtime_bundle)
    with open_runner(bundle, "llm", threads=1) as runner:
        assert isinstance(runner, OrtRunner)
        pairs = cache_pairs(runner.spec)
        rng = np.random.default_rng(0)
        plain: dict[str, Any] = empty_caches(runner.spec)
        kept: dict[str, Any] = dict(plain)
        for length in (5, 1, 1):
            embeds = rng.standard_normal((1, length, bundle.dims.llm_hidden)).astype(np.float32)
            want = runner.infer({"inputs_embeds": embeds, **plain})
            host, device = runner.infer_kept({"inputs_embeds": embeds, **kept}, keep=[n for _, n in pairs])
            assert set(host) == {"logp"} and all(isinstance(v, ort.OrtValue) for v in device.values())
            np.testing.assert_array_equal(host["logp"], want["logp"])
            for _, present in pairs:
                np.testing.assert_array_equal(device[present].numpy(), want[present])
            plain = {p: want[n] for p, n in pairs}
            kept = {p: device[n] for p, n in pairs}
        assert runner.infer({"inputs_embeds": embeds, **kept})["logp"].shape == want["logp"].shape
        wrong = {**kept, pairs[0][0]: ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, 1, 1), np.float32))}
        with pytest.raises(FeedError, match=rf"llm\.{pairs[0][0]}: shape \(1, 1, 1, 1\), dim 1"):
            runner.infer_kept({"inputs_embeds": embeds, **wrong}, keep=[])


class HostRunner(RunnerBase):
    """A runner with `RunnerBase`'s own `infer_kept`: onnxruntime underneath, called by `infer_outputs`."""

    def __init__(self, inner: OrtRunner) -> None:
        super().__init__(inner.spec)
        self.inner = inner

    def _run(self, feeds: Mapping[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        return self.inner.infer_outputs(feeds, names)

    def _release(self) -> None:
        self.inner.close()


def test_infer_kept_by_default_returns_the_kept_outputs_as_feeds(bundle: RuntimeBundle) -> None:
    """`RunnerBase.infer_kept`: the kept outputs come back as numpy arrays, which the next call takes as
    feeds; step after step they equal `OrtRunner.infer_kept`'s (IOBinding)."""
    inner = open_runner(bundle, "llm", threads=1)
    assert isinstance(inner, OrtRunner)
    with HostRunner(inner) as runner:
        assert isinstance(runner, Runner)
        pairs = cache_pairs(runner.spec)
        keep = [n for _, n in pairs]
        rng = np.random.default_rng(1)
        bound: dict[str, Any] = empty_caches(runner.spec)
        host_cache: dict[str, Any] = dict(bound)
        for length in (5, 1, 1):
            embeds = rng.standard_normal((1, length, bundle.dims.llm_hidden)).astype(np.float32)
            want, device = inner.infer_kept({"inputs_embeds": embeds, **bound}, keep)
            got, kept = runner.infer_kept({"inputs_embeds": embeds, **host_cache}, keep)
            assert set(got) == {"logp"} and list(kept) == keep
            assert all(isinstance(v, np.ndarray) for v in kept.values())
            np.testing.assert_array_equal(got["logp"], want["logp"])
            for name in keep:
                np.testing.assert_array_equal(kept[name], device[name].numpy())
            bound = {p: device[n] for p, n in pairs}
            host_cache = {p: kept[n] for p, n in pairs}
        with pytest.raises(ValueError, match="llm: unknown output 'logits'"):
            runner.infer_kept({"inputs_embeds": embeds, **host_cache}, keep=["logits"])
    with pytest.raises(RuntimeError, match="runner is closed"):
        runner.infer_kept({"inputs_embeds": embeds, **host_cache}, keep)
