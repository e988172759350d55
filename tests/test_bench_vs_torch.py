"""`cosyvoice-bench` beside the torch reference on the tiny bundle: the pinned LLM steps give the reference's
tokens, the bounds count the networks' FLOPs as torch does, and a quick `--vs-torch` run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import torch
from click.testing import CliRunner
from test_bench import PINNED, StopFirst, bench_args, check_common, check_figures, pinned_request
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from cosyvoice_bench.bounds import dit_flops_per_step, hift_flops
from cosyvoice_bench.cases import make_cases
from cosyvoice_bench.cli import main
from cosyvoice_bench.errors import BenchError
from cosyvoice_bench.measure import CallLog
from cosyvoice_bench.peak_rss import PeakJob, fresh_peak
from cosyvoice_bench.report import FIGURE_KEYS
from cosyvoice_export.bundle.layout import PROMPT_TEXT, PROMPT_WAV
from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.nets.dit import dit_attention_mask
from cosyvoice_export.nets.llm import CosyVoice3LM
from cosyvoice_export.onnx.wrappers.hift import PolyphaseUpsample
from cosyvoice_export.reference.llm_decode import TorchGreedySampler, generate_speech_tokens
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.sampling import GreedySampler
from cosyvoice_runtime.synthesis import Synthesizer

# --- the pinned step count ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_lm(tiny_bundle: Path) -> CosyVoice3LM:
    net = ModelBundle.open(tiny_bundle).load_network("llm")
    assert isinstance(net, CosyVoice3LM)
    return net


def test_pinned_greedy_tokens_equal_the_reference(runtime_bundle: Path, torch_lm: CosyVoice3LM) -> None:
    with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1) as synth:
        lm = synth.lm
        request = pinned_request(lm)
        runtime = lm.decode(request, GreedySampler(), max_tokens=PINNED, ignore_stop=True)
        tokens = runtime.run()
        log = CallLog()
        with log.wrap({"step": (torch_lm, "forward_step")}):
            reference = generate_speech_tokens(torch_lm, request.text_ids, request.prompt_text_ids,
                                               request.prompt_speech_tokens, lm.endofprompt_id,
                                               TorchGreedySampler(), max_tokens=PINNED, ignore_stop=True)
        assert reference == tokens and len(log.seconds("step")) == runtime.steps == PINNED
        eos = lm.speech_token_size + 1
        stop_first = StopFirst(eos)
        assert generate_speech_tokens(torch_lm, request.text_ids, request.prompt_text_ids,
                                      request.prompt_speech_tokens, lm.endofprompt_id, stop_first,
                                      max_tokens=PINNED) == []
        pinned = generate_speech_tokens(torch_lm, request.text_ids, request.prompt_text_ids,
                                        request.prompt_speech_tokens, lm.endofprompt_id, stop_first,
                                        max_tokens=PINNED, ignore_stop=True)
        assert pinned == lm.decode(request, stop_first, max_tokens=PINNED, ignore_stop=True).run()
        assert "forward_step" not in vars(torch_lm)  # CallLog put the method back


# --- the hardware bounds' FLOP counts -------------------------------------------------------------------


def test_flop_counts_equal_torchs_count_of_the_networks(tiny_bundle: Path) -> None:
    """`dit_flops_per_step` and `hift_flops` count what torch's flop counter counts running the networks
    as the graphs do: the DiT with its time modulation precomputed (HiFT's last stage runs one frame more
    than it counts)."""
    bundle = ModelBundle.open(tiny_bundle)
    frames = 37
    dit = bundle.load_network("flow").decoder.estimator
    x, mu, cond = (torch.randn(2, dit.cfg.mel_dim, frames) for _ in range(3))
    mask = torch.ones(2, 1, frames)
    with torch.no_grad():
        modulation = dit.modulation(torch.rand(1))
    # the math backend's matmuls are counted; the CPU flash attention kernel is not
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as dit_count:
        dit.forward_cached(x, mu, modulation, torch.randn(2, dit.cfg.spk_dim), cond, torch.arange(frames),
                           dit_attention_mask(mask, False, frames), mask.bool().transpose(1, 2), None, None)
    assert dit_flops_per_step(dit.cfg, frames) == pytest.approx(dit_count.get_total_flops(), rel=1e-4)
    hift = bundle.load_network("hift")
    # the upsampling layers as the exported graph runs them (each one polyphase conv at the input's rate);
    # the counter also counts folding their taps, work on the weights alone that the graph holds folded
    hift.ups = nn.ModuleList(PolyphaseUpsample(up) for up in hift.ups)
    folding = sum(2 * up.layer.upsample_factor * up.taps * up.layer.weight.numel() for up in hift.ups)
    mel = torch.randn(1, hift.cfg.in_channels, frames)
    noise = torch.rand(1, frames * hift.cfg.upsample_scale, hift.cfg.nb_harmonics + 1)
    with torch.no_grad(), FlopCounterMode(display=False) as hift_count:
        hift.inference(mel, noise, finalize=True)
    assert hift_flops(hift.cfg, frames) == pytest.approx(hift_count.get_total_flops() - folding, rel=1e-4)


# --- the benchmark --------------------------------------------------------------------------------------


def _prompt_args(tiny_bundle: Path) -> list[str]:
    return ["--prompt-wav", str(tiny_bundle / PROMPT_WAV),
            "--prompt-text", (tiny_bundle / PROMPT_TEXT).read_text().strip()]


def test_quick_run_beside_the_torch_reference(runtime_bundle: Path, tiny_bundle: Path, tmp_path: Path
                                              ) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "bench.json"
    args = [*bench_args(runtime_bundle, out), *_prompt_args(tiny_bundle), "--vs-torch",
            "--model-dir", str(tiny_bundle), "--lengths", "short,long", "--concurrency", "1"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    assert torch.get_num_threads() == threads  # the bench gives torch its thread count back
    assert "runtime ×" in done.stdout and "same speech tokens as torch: yes" in done.stdout
    result = json.loads(out.read_text())
    check_common(result, ["short", "long"], [1])
    assert result["machine"]["torch"] == torch.__version__
    for case in result["cases"]:
        check_figures(case["torch"], case["pinned_tokens"], torch_side=True)
        assert case["same_speech_tokens"] is True
        assert case["torch"]["first_chunk_audio_s"] == pytest.approx(case["runtime"]["first_chunk_audio_s"])
        assert all(case["bounds"][f"{stage}_fraction_torch"] > 0 for stage in ("llm", "dit", "hift"))
        speedup = case["speedup"]
        assert set(speedup) == set(FIGURE_KEYS)
        assert speedup["rtf_offline"] > 0 and speedup["rtf_stream"] is None and speedup["audio_s"] is None


def _rename_key(data: Any, old: str, new: str) -> Any:
    """`data` (parsed JSON) with every object key `old` renamed `new`."""
    if isinstance(data, dict):
        return {new if k == old else k: _rename_key(v, old, new) for k, v in data.items()}
    return [_rename_key(v, old, new) for v in data] if isinstance(data, list) else data


def test_the_reference_reads_the_bundles_llm_checkpoint(runtime_bundle: Path, tiny_bundle: Path,
                                                         tmp_path: Path) -> None:
    """A bundle exported with `--llm rl` is measured beside the reference with that LLM: here the graphs'
    weights are llm.rl.pt's and llm.pt holds another model's, so reading llm.pt would give other tokens."""
    from cosyvoice_export.bundle.tiny import write_bundle

    other = write_bundle(tmp_path / "other", seed=1)
    model = tmp_path / "model"
    model.mkdir()
    for path in tiny_bundle.iterdir():
        (model / path.name).symlink_to(path)
    (model / "llm.pt").unlink()
    (model / "llm.pt").symlink_to(other / "llm.pt")
    (model / "llm.rl.pt").symlink_to(tiny_bundle / "llm.pt")
    rl = shutil.copytree(runtime_bundle, tmp_path / "rl-runtime", copy_function=os.link)
    manifest = json.loads((rl / "manifest.json").read_text())
    assert manifest["llm_checkpoint"] == "llm.pt"
    manifest = _rename_key(manifest, "llm.pt", "llm.rl.pt") | {"llm_checkpoint": "llm.rl.pt"}
    (rl / "manifest.json").unlink()  # a hard link: the session's bundle keeps its own
    (rl / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "bench.json"
    done = CliRunner().invoke(main, [*bench_args(rl, out), *_prompt_args(tiny_bundle), "--vs-torch",
                                     "--model-dir", str(model), "--lengths", "short", "--concurrency", "1"])
    assert done.exit_code == 0, done.output
    assert "same speech tokens as torch: yes" in done.stdout
    assert [case["same_speech_tokens"] for case in json.loads(out.read_text())["cases"]] == [True]


def test_the_references_fresh_process_reads_the_llm_checkpoint_it_is_given(tiny_bundle: Path) -> None:
    """The child measuring the reference's peak RSS opens the LLM checkpoint of the job (the runtime
    bundle's), not llm.pt: one the model directory lacks fails there, named."""
    job = PeakJob("torch", tiny_bundle, tiny_bundle / PROMPT_WAV, (tiny_bundle / PROMPT_TEXT).read_text(),
                  threads=1, llm_checkpoint="llm.rl.pt")
    with pytest.raises(BenchError, match=r"^torch short: the fresh process measuring peak RSS failed "
                                         r"\(exit 2\): .*llm\.rl\.pt: file not found"):
        fresh_peak(job, make_cases(["short"], 5)[0])


def test_another_models_reference_is_refused_before_measuring(runtime_bundle: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """--model-dir must be the model the bundle was exported from, checked as `cosyvoice-golden update`
    checks it: one line naming the file that differs, before anything is measured."""
    from cosyvoice_bench import cli
    from cosyvoice_export.bundle.tiny import write_bundle

    monkeypatch.setattr(cli, "run", lambda *_, **__: pytest.fail("the benchmark ran"))
    other = write_bundle(tmp_path / "other", seed=1)
    done = CliRunner().invoke(main, [*bench_args(runtime_bundle, tmp_path / "x.json"), "--vs-torch",
                                     "--model-dir", str(other)])
    assert done.exit_code == 2 and done.stderr.count("\n") == 1, done.output
    assert done.stderr == (f"error: {other / 'llm.pt'} is not the llm.pt {runtime_bundle.resolve()} was "
                           "exported from (sha256 differs); --model-dir must be that model\n")
