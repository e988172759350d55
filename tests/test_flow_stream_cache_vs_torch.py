"""The flow caches' exactness at the DiT (test_flow_stream_cache has the argument): `DiT.forward_cached`
chained over chunks against one block-causal forward, a chunk boundary inside a block breaking that
equality, the exported `flow_estimator_cached` graph against the torch DiT, and the runtime's offline flow
against torch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import torch
from test_flow_stream_cache import BLOCK, MEL_MAX

from cosyvoice_export.bundle.model_dir import ModelBundle
from cosyvoice_export.config import full_size, tiny
from cosyvoice_export.nets import flow as flow_net
from cosyvoice_export.nets.dit import DiT, dit_attention_mask
from cosyvoice_export.reference.pipeline import ReferencePipeline
from cosyvoice_graphs import dit_attention, empty_caches, euler_steps
from cosyvoice_runtime.bundle import RuntimeBundle
from cosyvoice_runtime.frontend import PromptFeatures
from cosyvoice_runtime.synthesis import Synthesizer
from cosyvoice_runtime.token2wav import ENCODER_LEFT_CONTEXT

# --- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def synth(runtime_bundle: Path) -> Iterator[Synthesizer]:
    """One intra-op thread: the graphs round alike run after run."""
    with Synthesizer(RuntimeBundle.open(runtime_bundle), threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def pipe(tiny_bundle: Path) -> ReferencePipeline:
    return ReferencePipeline(ModelBundle.open(tiny_bundle))


@pytest.fixture(scope="module")
def dit() -> DiT:
    net = flow_net.CausalMaskedDiffWithDiT(tiny(832).flow).eval().requires_grad_(False)
    flow_net.init_random_(net, torch.Generator().manual_seed(0))
    return net.decoder.estimator


# --- the DiT with caches ----------------------------------------------------------------------------


def test_encoder_left_context_is_the_pre_lookahead_layers() -> None:
    """mu of a token reads 2 tokens back (conv2, causal k 3) and only forward in conv1 (k 4, unpadded)."""
    for cfg in (full_size().flow, tiny(100).flow):
        pll = flow_net.PreLookaheadLayer(cfg.input_size, 8, cfg.pre_lookahead_len)
        assert ENCODER_LEFT_CONTEXT == pll.conv2.kernel_size[0] - 1
        assert pll.conv1.kernel_size[0] == cfg.pre_lookahead_len + 1 and pll.conv1.padding == (0,)


STEP = 4
"""The Euler step whose time the DiT tests run at (the graph holds the steps' time modulation only)."""


def _dit_inputs(T: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, mu, cond = (torch.randn(2, 80, T, generator=g) for _ in range(3))
    return x, mu, torch.full((2,), float(euler_steps()[STEP][0])), torch.randn(2, 80, generator=g), cond


def _chained(dit: DiT, inputs: tuple[torch.Tensor, ...], schedule: list[int]) -> torch.Tensor:
    """`DiT.forward_cached` chunk after chunk (block-causal among each chunk's frames), caches fed back."""
    x, mu, t, spks, cond = inputs
    modulation = dit.modulation(t)  # what DiT.forward computes from t
    conv, kv, start, out = None, None, 0, []
    for n in schedule:
        part = slice(start, start + n)
        positions = torch.arange(start, start + n)
        past = 0 if kv is None else kv[0][0].shape[2]
        mask = torch.from_numpy(dit_attention(start, n, past, BLOCK)["attention_mask"])[None, None]
        keep = torch.ones(2, n, 1, dtype=torch.bool)
        v, conv, kv = dit.forward_cached(x[:, :, part], mu[:, :, part], modulation, spks, cond[:, :, part],
                                         positions, mask, keep, conv, kv)
        out.append(v)
        start += n
    return torch.cat(out, dim=2)


SCHEDULES = {
    "upstream": [300, 100, 200, 200],  # prompt + first hop, then hops of 50, 100, 100 tokens
    "blocks": [50, 50, 150, 50],
    "one-chunk": [250],
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_chained_dit_equals_the_block_causal_forward(dit: DiT, name: str) -> None:
    schedule = SCHEDULES[name]
    inputs = _dit_inputs(sum(schedule))
    x, mu, t, spks, cond = inputs
    mask = torch.ones(2, 1, x.shape[2])
    with torch.no_grad():
        want = dit(x, mask, mu, t, spks, cond, dit_attention_mask(mask, True, BLOCK))
        got = _chained(dit, inputs, schedule)
    err = float((got - want).abs().max())
    print(f"{name}: chained vs one forward max abs {err:.2e}")
    assert err < 1e-5


def test_a_chunk_boundary_inside_a_block_breaks_the_equality(dit: DiT) -> None:
    """Frames 100..119 see frames 120..149 in the one forward, which their cached keys never did."""
    inputs = _dit_inputs(300)
    x, mu, t, spks, cond = inputs
    mask = torch.ones(2, 1, 300)
    with torch.no_grad():
        want = dit(x, mask, mu, t, spks, cond, dit_attention_mask(mask, True, BLOCK))
        got = _chained(dit, inputs, [120, 180])
    assert float((got[:, :, :100] - want[:, :, :100]).abs().max()) < 1e-5  # whole blocks before it
    assert float((got[:, :, 100:120] - want[:, :, 100:120]).abs().max()) > 1e-3


def _one_forward(pipe: ReferencePipeline, inputs: tuple[torch.Tensor, ...], streaming: bool) -> np.ndarray:
    """The bundle's torch DiT over every frame at once (block-causal or full attention): upstream's call."""
    x, mu, t, spks, cond = inputs
    mask = torch.ones(2, 1, x.shape[2])
    with torch.no_grad():
        return pipe.flow.decoder.estimator(x, mask, mu, t, spks, cond,
                                           dit_attention_mask(mask, streaming, BLOCK)).numpy()


@pytest.mark.parametrize("frames", [7, 123, 451])
@pytest.mark.parametrize("streaming", [True, False])
def test_the_graph_with_nothing_cached_is_one_dit_forward(synth: Synthesizer, pipe: ReferencePipeline,
                                                          frames: int, streaming: bool) -> None:
    """The exported graph as the runtime calls it for the offline flow, a stream's first chunk and its
    final re-run (empty caches, offset 0, the velocity only) against the torch DiT over the same frames;
    the wrapper it is traced from is `DiT.forward` bit for bit (test_export_wrappers_llm_flow), so this
    is onnxruntime's rounding."""
    inputs = _dit_inputs(frames, seed=frames)
    x, mu, t, spks, cond = (a.numpy() for a in inputs)
    estimator = synth.flow.estimator
    got = estimator.infer_outputs({"x": x, "mu": mu, "ode_step": np.array([STEP]), "spks": spks, "cond": cond,
                                   **dit_attention(0, frames, 0, BLOCK if streaming else frames),
                                   **empty_caches(estimator.spec)}, ["velocity"])
    assert list(got) == ["velocity"]
    err = float(np.abs(got["velocity"] - _one_forward(pipe, inputs, streaming)).max())
    print(f"{frames} frames, {'block-causal' if streaming else 'full attention'}: graph vs torch max abs "
          f"{err:.2e}")
    assert err < 1e-5


def test_cached_graph_chain_equals_one_dit_forward(synth: Synthesizer, pipe: ReferencePipeline) -> None:
    """The exported graph chained over chunks, caches fed back = the torch DiT's one block-causal call."""
    estimator = synth.flow.estimator
    inputs = _dit_inputs(400, seed=4)
    x, mu, t, spks, cond = (a.numpy() for a in inputs)
    caches, start, got = empty_caches(estimator.spec), 0, []
    for n in [250, 50, 100]:
        part = slice(start, start + n)
        out = estimator.infer({"x": x[:, :, part], "mu": mu[:, :, part], "ode_step": np.array([STEP]),
                               "spks": spks, "cond": cond[:, :, part],
                               **dit_attention(start, n, start, BLOCK), **caches})
        caches = {name: out["present_" + name.removeprefix("past_")] for name in caches}
        got.append(out["velocity"])
        start += n
    err = float(np.abs(np.concatenate(got, axis=2) - _one_forward(pipe, inputs, streaming=True)).max())
    print(f"graphs: chained flow_estimator_cached vs one torch forward max abs {err:.2e}")
    assert err < 1e-5


# --- the offline flow -------------------------------------------------------------------------------


def test_offline_flow_is_unchanged(synth: Synthesizer, pipe: ReferencePipeline, prompt: PromptFeatures
                                   ) -> None:
    """The refactored `Flow` (shared encoder, cond, noise and Euler helpers) still equals torch offline."""
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, 6561, 90)]
    got = synth.flow(np.asarray(tokens), prompt, finalize=True, streaming=False)
    with torch.no_grad():
        want = pipe.flow.inference(torch.tensor([tokens]), torch.from_numpy(prompt.speech_tokens),
                                   torch.from_numpy(prompt.mel), torch.from_numpy(prompt.embedding),
                                   pipe.noise.flow_noise, streaming=False, finalize=True).numpy()
    assert got.shape == want.shape == (1, 80, 180)
    assert float(np.abs(got - want).max()) < MEL_MAX
