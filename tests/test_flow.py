"""The flow network: key layout against upstream's manifest, DiT pieces against direct formulas,
the CFG sampler, and streaming exactness under upstream's chunk orchestration."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import torch
from torch import Tensor, nn

from cosyvoice_export.config import FlowConfig, full_size, tiny
from cosyvoice_export.nets.cfm import CausalConditionalCFM, time_grid
from cosyvoice_export.nets.dit import (
    DiT,
    _apply_rope,
    _RotaryEmbedding,
    _SinusPositionEmbedding,
    dit_attention_mask,
)
from cosyvoice_export.nets.flow import CausalMaskedDiffWithDiT, PreLookaheadLayer, init_random_
from cosyvoice_graphs import ODE_STEPS, euler_steps

MANIFEST = Path(__file__).parent / "data" / "upstream_manifest" / "flow.tsv"
LOOKAHEAD = 3


def _small_cfg() -> FlowConfig:
    """tiny()'s flow, thinner still: 2 heads of 16, 32 wide."""
    base = tiny(1024).flow
    dit = dataclasses.replace(base.dit, dim=32, heads=2, dim_head=16, conv_pos_groups=8)
    return dataclasses.replace(base, pre_lookahead_channels=32, dit=dit)


@pytest.fixture(scope="module")
def flow() -> CausalMaskedDiffWithDiT:
    net = CausalMaskedDiffWithDiT(_small_cfg()).eval().requires_grad_(False)
    init_random_(net, torch.Generator().manual_seed(0))
    return net


@pytest.fixture(scope="module")
def noise() -> Tensor:
    return torch.randn(1, 80, 1000, generator=torch.Generator().manual_seed(0))


def _request(P: int, N: int, seed: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random speech tokens (1, N), prompt tokens (1, P), prompt mel (1, 2P, 80), x-vector (1, 192)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 6561, (1, N), generator=g)
    prompt = torch.randint(0, 6561, (1, P), generator=g)
    prompt_feat = torch.randn(1, 2 * P, 80, generator=g) - 5.0
    return tokens, prompt, prompt_feat, torch.randn(1, 192, generator=g)


# --- key layout -------------------------------------------------------------------------------


def test_full_size_state_dict_matches_upstream_manifest() -> None:
    with torch.device("meta"):
        net = CausalMaskedDiffWithDiT(full_size().flow)
    got = [(k, list(t.shape), str(t.dtype).removeprefix("torch."))
           for k, t in net.state_dict(keep_vars=True).items()]
    want = []
    for line in MANIFEST.read_text().splitlines():
        key, shape, dtype = line.split("\t")
        want.append((key, json.loads(shape), dtype))
    assert len(want) == 330
    assert got == want
    assert "rotary_embed.inv_freq" in dict(net.decoder.estimator.named_buffers())


# --- DiT pieces -------------------------------------------------------------------------------


def test_rope_inv_freq_full_size() -> None:
    inv_freq = _RotaryEmbedding(full_size().flow.dit.dim_head).inv_freq
    assert inv_freq.shape == (32,)
    expected = torch.tensor([1.0, 0.74989420, 0.56234133, 0.42169651])
    torch.testing.assert_close(inv_freq[:4], expected, atol=1e-7, rtol=0)


def test_rope_rotates_adjacent_pairs_of_the_first_head_only() -> None:
    dim_head, width, T = 16, 64, 9
    x = torch.randn(2, T, width, generator=torch.Generator().manual_seed(3))
    freqs = _RotaryEmbedding(dim_head)(torch.arange(T))
    y = _apply_rope(x, freqs.cos(), freqs.sin())
    assert torch.equal(y[..., dim_head:], x[..., dim_head:])
    # Pair (2m, 2m+1) as a complex number, turned by p * 10000^(-2m/dim_head) at position p.
    x64 = x.double()
    z = torch.complex(x64[..., 0:dim_head:2], x64[..., 1:dim_head:2])  # (2, T, dim_head/2)
    p = torch.arange(T, dtype=torch.float64)[:, None]
    m = torch.arange(dim_head // 2, dtype=torch.float64)[None, :]
    turned = z * torch.polar(torch.ones(()).double(), p * 10000.0 ** (-2 * m / dim_head))
    expected = torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)
    torch.testing.assert_close(y[..., :dim_head].double(), expected, atol=1e-5, rtol=0)
    assert not torch.allclose(y[:, 1:, :dim_head], x[:, 1:, :dim_head])


@pytest.mark.parametrize("streaming", [False, True])
def test_dit_attention_mask_matches_loop(streaming: bool) -> None:
    T, chunk = 23, 5
    lengths = [23, 17, 4, 0]
    pad = torch.zeros(len(lengths), 1, T)
    for b, n in enumerate(lengths):
        pad[b, 0, :n] = 1.0
    got = dit_attention_mask(pad, streaming, chunk)
    assert got.shape == (len(lengths), 1, T, T) and got.dtype == torch.bool
    want = torch.zeros_like(got)
    for b, n in enumerate(lengths):
        for i in range(T):
            for j in range(T):
                want[b, 0, i, j] = j < n and (not streaming or j < (i // chunk + 1) * chunk)
            if not want[b, 0, i].any():  # upstream opens rows with no visible key
                want[b, 0, i] = True
    assert torch.equal(got, want)


def test_time_grid_cosine_and_linear() -> None:
    expected = [1 - math.cos(k / 10 * math.pi / 2) for k in range(11)]
    torch.testing.assert_close(time_grid(10), torch.tensor(expected), atol=1e-7, rtol=0)
    assert time_grid(10)[5].item() == pytest.approx(0.29289322, abs=1e-7)
    torch.testing.assert_close(time_grid(4, "linear"), torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))


def test_time_embedding_matches_formula() -> None:
    t = torch.tensor([0.0, 1e-3, 0.29289322, 0.75, 1.0])
    got = _SinusPositionEmbedding(256)(t)
    k = torch.arange(128, dtype=torch.float64)
    arg = 1000.0 * t.double()[:, None] * torch.exp(-k * math.log(10000.0) / 127)[None, :]
    expected = torch.cat((arg.sin(), arg.cos()), dim=1)
    # fp32 arguments reach 1000, where one ulp is 6e-5.
    torch.testing.assert_close(got.double(), expected, atol=3e-4, rtol=0)
    assert torch.equal(got[0], torch.cat((torch.zeros(128), torch.ones(128))))


def _dit_inputs(T: int, B: int = 2, seed: int = 0) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, 80, T, generator=g), torch.ones(B, 1, T), torch.randn(B, 80, T, generator=g),
            torch.rand(B, generator=g), torch.randn(B, 80, generator=g), torch.randn(B, 80, T, generator=g))


def test_dit_input_concat_order() -> None:
    """proj's columns read [x, cond, mu, spks]: zeroing one block of columns silences that input."""
    dit = DiT(_small_cfg().dit).requires_grad_(False)
    x, mask, mu, t, spks, cond = _dit_inputs(20)
    attn = dit_attention_mask(mask, False, 50)
    weight = dit.input_embed.proj.weight.clone()
    arg_index = [0, 5, 2, 4]  # x, cond, mu, spks as positions in forward's argument list
    for n, idx in enumerate(arg_index):
        dit.input_embed.proj.weight.copy_(weight)
        dit.input_embed.proj.weight[:, 80 * n:80 * (n + 1)] = 0.0
        args = [x, mask, mu, t, spks, cond]
        base = dit(*args, attn)
        args[idx] = torch.randn_like(args[idx])
        assert torch.equal(dit(*args, attn), base)
        other = arg_index[(n + 1) % 4]  # an input whose columns are intact still matters
        args[other] = torch.randn_like(args[other])
        assert not torch.allclose(dit(*args, attn), base)


def test_dit_padding_keys_ignored_and_query_rows_zeroed(flow: CausalMaskedDiffWithDiT) -> None:
    dit = flow.decoder.estimator
    x, mask, mu, t, spks, cond = _dit_inputs(30)
    mask[1, :, 21:] = 0.0
    attn = dit_attention_mask(mask, False, 50)
    outs: list[Tensor] = []
    hook = dit.transformer_blocks[0].attn.register_forward_hook(lambda m, a, o: outs.append(o[0]))
    try:
        base = dit(x, mask, mu, t, spks, cond, attn)
    finally:
        hook.remove()
    assert torch.equal(outs[0][1, 21:], torch.zeros(9, outs[0].shape[-1]))
    assert outs[0][1, :21].abs().min() > 0
    x2 = x.clone()
    x2[1, :, 21:] += 10.0
    torch.testing.assert_close(dit(x2, mask, mu, t, spks, cond, attn)[1, :, :21], base[1, :, :21],
                               atol=1e-5, rtol=0)


def test_dit_trace_serves_other_lengths_and_masks(flow: CausalMaskedDiffWithDiT) -> None:
    dit = flow.decoder.estimator
    small = _dit_inputs(30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace's deprecation notice
        traced = torch.jit.trace(dit, (*small, dit_attention_mask(small[1], True, 50)))
    big = _dit_inputs(77, seed=1)
    attn = dit_attention_mask(big[1], False, 50)
    torch.testing.assert_close(traced(*big, attn), dit(*big, attn), atol=1e-6, rtol=0)


# --- CFM sampler ------------------------------------------------------------------------------


def test_cfg_unconditional_row_sees_zeros(flow: CausalMaskedDiffWithDiT) -> None:
    cfm = flow.decoder
    x, mask, mu, _, spks, cond = _dit_inputs(12, B=1)
    calls: list[tuple[Tensor, ...]] = []
    hook = cfm.estimator.register_forward_pre_hook(lambda m, a: calls.append(tuple(y.clone() for y in a)))
    try:
        cfm(mu, mask, spks, cond, x, streaming=True, n_timesteps=4)
    finally:
        hook.remove()
    assert len(calls) == 4
    grid = time_grid(4)
    for step, (x_in, mask_in, mu_in, t_in, spks_in, cond_in, attn_in) in enumerate(calls):
        assert x_in.shape == (2, 80, 12)
        assert torch.equal(x_in[0], x_in[1]) and torch.equal(mask_in[1], mask[0])
        assert torch.equal(mu_in[0], mu[0]) and torch.equal(cond_in[0], cond[0])
        assert torch.equal(spks_in[0], spks[0])
        assert not mu_in[1].any() and not spks_in[1].any() and not cond_in[1].any()
        assert t_in[0] == t_in[1] and t_in[0].item() == pytest.approx(grid[step].item(), abs=1e-6)
        assert torch.equal(attn_in[1], attn_in[0])
        assert torch.equal(attn_in[0], dit_attention_mask(mask, True, 50)[0])
    assert torch.equal(calls[0][0][0], x[0])


def test_euler_steps_are_the_samplers_times(flow: CausalMaskedDiffWithDiT) -> None:
    """`euler_steps`, at whose times the DiT graph holds the time modulation, are the times upstream's
    loop (`solve_euler`, t accumulated) calls the DiT at, bit for bit."""
    cfm = flow.decoder
    assert cfm.cfm.n_timesteps == ODE_STEPS
    x, mask, mu, _, spks, cond = _dit_inputs(12, B=1)
    times: list[float] = []
    hook = cfm.estimator.register_forward_pre_hook(lambda m, a: times.append(a[3][0].item()))
    try:
        cfm(mu, mask, spks, cond, x, streaming=False)
    finally:
        hook.remove()
    assert times == [float(t) for t, _ in euler_steps()]
    assert sum(float(dt) for _, dt in euler_steps()) == pytest.approx(1.0, abs=1e-6)


class _FixedVelocity(nn.Module):
    """Stands in for the DiT: `a` for the conditional row, `b` for the unconditional one."""

    def __init__(self, a: Tensor, b: Tensor) -> None:
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x: Tensor, *_: Tensor) -> Tensor:
        return torch.cat((self.a, self.b))


def test_cfg_velocity_combination() -> None:
    cfg = _small_cfg()
    cfm = CausalConditionalCFM(cfg.cfm, cfg.dit)
    g = torch.Generator().manual_seed(5)
    a, b, z = (torch.randn(1, 80, 7, generator=g) for _ in range(3))
    cfm.estimator = _FixedVelocity(a, b)
    out = cfm(torch.zeros_like(z), torch.ones(1, 1, 7), torch.zeros(1, 80), torch.zeros_like(z), z,
              streaming=False)
    # The dt's of the accumulated-t Euler loop sum to 1, so x1 = x0 + 1.7 a - 0.7 b.
    torch.testing.assert_close(out, z + 1.7 * a - 0.7 * b, atol=1e-5, rtol=0)


# --- pre-lookahead layer ----------------------------------------------------------------------


def test_pre_lookahead_matches_direct_formula() -> None:
    g = torch.Generator().manual_seed(7)
    pll = PreLookaheadLayer(3, 5, LOOKAHEAD)
    for p in pll.parameters():
        p.data = torch.randn(p.shape, generator=g)
    x = torch.randn(1, 6, 3, generator=g)
    w1, b1, w2, b2 = (p.detach().double() for p in (pll.conv1.weight, pll.conv1.bias,
                                                     pll.conv2.weight, pll.conv2.bias))
    xs = x[0].double()
    T = xs.shape[0]

    def hidden(s: int) -> Tensor:  # conv1 at frame s, zeros past the end; zero before frame 0 (causal pad)
        if s < 0:
            return torch.zeros(5, dtype=torch.float64)
        acc = b1.clone()
        for k in range(LOOKAHEAD + 1):
            if s + k < T:
                acc += w1[:, :, k] @ xs[s + k]
        return torch.where(acc > 0, acc, 0.01 * acc)

    expected = torch.stack([xs[t] + b2 + sum(w2[:, :, k] @ hidden(t - 2 + k) for k in range(3))
                            for t in range(T)])
    torch.testing.assert_close(pll(x)[0].double(), expected, atol=1e-5, rtol=0)


def test_pre_lookahead_context_equals_concatenation_minus_tail() -> None:
    pll = PreLookaheadLayer(80, 32, LOOKAHEAD)
    x = torch.randn(1, 20, 80, generator=torch.Generator().manual_seed(8))
    with_context = pll(x[:, :-LOOKAHEAD], x[:, -LOOKAHEAD:])
    assert with_context.shape == (1, 17, 80)
    torch.testing.assert_close(with_context, pll(x)[:, :-LOOKAHEAD], atol=1e-6, rtol=0)
    # Without context the tail sees zeros, which differs from the real look-ahead.
    assert (pll(x[:, :-LOOKAHEAD])[:, -1] - with_context[:, -1]).abs().max() > 1e-3


# --- flow inference ---------------------------------------------------------------------------


def test_output_lengths(flow: CausalMaskedDiffWithDiT, noise: Tensor) -> None:
    tokens, prompt, prompt_feat, xvec = _request(P=7, N=11)
    final = flow.inference(tokens, prompt, prompt_feat, xvec, noise, streaming=False, finalize=True)
    partial = flow.inference(tokens, prompt, prompt_feat, xvec, noise, streaming=True, finalize=False)
    assert final.shape == (1, 80, 2 * 11) and final.dtype == torch.float32
    assert partial.shape == (1, 80, 2 * (11 - LOOKAHEAD))


@pytest.mark.parametrize("finalize", [True, False])
def test_inference_feeds_the_decoder_as_upstream(flow: CausalMaskedDiffWithDiT, noise: Tensor,
                                                 finalize: bool) -> None:
    P, N = 5, 9
    tokens, prompt, prompt_feat, xvec = _request(P, N)
    tokens[0, 2] = -1  # negative ids are clamped to 0
    seen: list[tuple[Tensor, ...]] = []
    hook = flow.decoder.register_forward_pre_hook(lambda m, a: seen.append(a))
    try:
        flow.inference(tokens, prompt, prompt_feat, 3.0 * xvec, noise, streaming=True, finalize=finalize)
    finally:
        hook.remove()
    mu, mask, spks, cond, z = seen[0]
    T = 2 * (P + N) if finalize else 2 * (P + N - LOOKAHEAD)
    assert mu.shape == cond.shape == z.shape == (1, 80, T) and torch.equal(mask, torch.ones(1, 1, T))
    assert torch.equal(cond[:, :, :2 * P], prompt_feat.transpose(1, 2)) and not cond[:, :, 2 * P:].any()
    assert torch.equal(z, noise[:, :, :T])
    torch.testing.assert_close(spks, flow.spk_embed_affine_layer(xvec / xvec.norm()), atol=1e-6, rtol=0)
    ids = torch.cat((prompt, tokens), dim=1).clamp(min=0)
    assert ids[0, P + 2] == 0
    h = flow.pre_lookahead_layer(flow.input_embedding(ids))[:, :T // 2]  # non-final: look-ahead is real
    torch.testing.assert_close(mu[:, :, 0::2], h.transpose(1, 2), atol=1e-5, rtol=0)
    assert torch.equal(mu[:, :, 1::2], mu[:, :, 0::2])


def test_init_random_is_deterministic_and_gives_log_mel_like_output(
        flow: CausalMaskedDiffWithDiT, noise: Tensor) -> None:
    other = CausalMaskedDiffWithDiT(_small_cfg())
    init_random_(other, torch.Generator().manual_seed(0))
    for (k, v), w in zip(flow.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    fresh = _RotaryEmbedding(_small_cfg().dit.dim_head).inv_freq
    assert torch.equal(flow.decoder.estimator.rotary_embed.inv_freq, fresh)
    mel = flow.inference(*_request(P=10, N=30), noise, streaming=False, finalize=True)
    assert torch.isfinite(mel).all()
    assert -9.0 < mel.mean().item() < -1.0 and 1.0 < mel.std().item() < 5.0 and mel.abs().max() < 30.0


def _stream(flow: CausalMaskedDiffWithDiT, noise: Tensor, request: tuple[Tensor, ...], pad: int
            ) -> tuple[list[tuple[int, Tensor]], int, Tensor]:
    """Upstream's streaming token2wav loop (model.py) with the deterministic exit rule.

    Hops are 25+pad, 50, 100, 100, ... tokens. Returns the non-final chunks as (token offset, kept
    mel), the final offset, and the final chunk.
    """
    tokens, prompt, prompt_feat, xvec = request
    chunks, offset, base = [], 0, 25
    hop = base + pad
    while tokens.shape[1] - offset >= hop + LOOKAHEAD:
        mel = flow.inference(tokens[:, :offset + hop + LOOKAHEAD], prompt, prompt_feat, xvec, noise,
                             streaming=True, finalize=False)
        chunks.append((offset, mel[:, :, 2 * offset:]))
        offset += hop
        base = min(2 * base, 100)
        hop = base
    final = flow.inference(tokens, prompt, prompt_feat, xvec, noise, streaming=False, finalize=True)
    return chunks, offset, final[:, :, 2 * offset:]


def test_streaming_chunks_equal_one_streaming_pass(flow: CausalMaskedDiffWithDiT, noise: Tensor) -> None:
    P, N = 13, 107
    request = _request(P, N)
    pad = math.ceil(P / 25) * 25 - P
    chunks, offset, final = _stream(flow, noise, request, pad)
    assert [o for o, _ in chunks] == [0, 25 + pad] and offset == 25 + pad + 50

    streamed = flow.inference(*request, noise, streaming=True, finalize=True)
    offline = flow.inference(*request, noise, streaming=False, finalize=True)
    worst = 0.0
    for start, mel in chunks:
        ref = streamed[:, :, 2 * start:2 * start + mel.shape[2]]
        worst = max(worst, (mel - ref).abs().max().item())
    print(f"streaming chunks vs one streaming pass: max |diff| = {worst:.3g}")
    assert worst < 1e-5
    assert torch.equal(final, offline[:, :, 2 * offset:])
    assert torch.cat([m for _, m in chunks] + [final], dim=2).shape == (1, 80, 2 * N)
    # The final chunk attends over everything, so it must differ from the block-causal pass.
    assert (final - streamed[:, :, 2 * offset:]).abs().max() > 1e-3


def test_streaming_without_pad_breaks_the_first_chunk(flow: CausalMaskedDiffWithDiT, noise: Tensor) -> None:
    P, N = 13, 107
    request = _request(P, N)
    chunks, _, _ = _stream(flow, noise, request, pad=0)
    first = chunks[0][1]  # generated frames 0..49 = absolute frames 26..75; the DiT block ends at 50
    streamed = flow.inference(*request, noise, streaming=True, finalize=True)[:, :, :first.shape[2]]
    inside = (first[:, :, :50 - 2 * P] - streamed[:, :, :50 - 2 * P]).abs().max().item()
    across = (first[:, :, 50 - 2 * P:] - streamed[:, :, 50 - 2 * P:]).abs().max().item()
    print(f"unpadded first chunk: block 0 max |diff| = {inside:.3g}, block 1 max |diff| = {across:.3g}")
    assert inside < 1e-5
    assert across > 1e-3
