"""Construction-time noise tables: the sha256 and first values of the tables upstream's constructors draw
(example yaml, torch's CPU generator), and the replayed draw order."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import pytest

pytest.importorskip("torch", reason="needs torch (the export extra)")
pytestmark = pytest.mark.torch

import numpy as np
import torch
from torch import nn

from cosyvoice_export.config import ModelConfig, full_size, tiny
from cosyvoice_export.nets.hift import CausalConvRNNF0Predictor
from cosyvoice_export.noise import NoiseTables, flow_noise, noise_tables, table_sha256
from cosyvoice_runtime.noise import UniformNoise


@pytest.fixture(scope="module")
def full() -> NoiseTables:
    return noise_tables(full_size())


def _small(cond_channels: int = 32) -> ModelConfig:
    """Tiny dims, 1 s of HiFT noise, 100 flow frames, 5 harmonics: cheap, and unlike upstream's shapes."""
    cfg = tiny(64)
    f0 = dataclasses.replace(cfg.hift.f0, cond_channels=cond_channels)
    hift = dataclasses.replace(cfg.hift, nb_harmonics=4, noise_seconds=1, f0=f0)
    flow = dataclasses.replace(cfg.flow, cfm=dataclasses.replace(cfg.flow.cfm, noise_frames=100))
    return dataclasses.replace(cfg, flow=flow, hift=hift)


def test_full_size_shapes(full: NoiseTables) -> None:
    assert full.flow_noise.shape == (1, 80, 15000)
    assert full.rand_ini.shape == (1, 9)
    assert full.sine_waves.shape == (1, 7_200_000, 9)
    assert full.uv.shape == (1, 7_200_000, 1)
    assert all(t.dtype == torch.float32 for t in (full.flow_noise, full.rand_ini, full.sine_waves, full.uv))


def test_flow_noise_fingerprint(full: NoiseTables) -> None:
    assert table_sha256(full.flow_noise) == "584a26e6eaad944407a96c5999aaa5cd0a6a359309a841eade68bf805c072322"
    first = [-1.1258398, -1.1523602, -0.2505786, -0.4338788, 0.8487104]
    np.testing.assert_allclose(full.flow_noise[0, 0, :5].numpy(), first, atol=1e-7)
    assert torch.equal(flow_noise(full_size()), full.flow_noise)


def test_sine_waves_fingerprint(full: NoiseTables) -> None:
    assert table_sha256(full.sine_waves) == "2f60f92217f65e9f2728d4e662f520432603d88e7a24f78666cc88bb76247f61"
    first_row = [0.92282599, 0.47744751, 0.82705182, 0.28345716, 0.79348159]
    first_row += [0.17343479, 0.85237503, 0.9228546, 0.73101997]
    np.testing.assert_allclose(full.sine_waves[0, 0].numpy(), first_row, atol=1e-7)


def test_uv_fingerprint(full: NoiseTables) -> None:
    assert table_sha256(full.uv) == "d498fff51790510286a8d5dd79457f9240ebf4495a1b513e7a9ca4636ee6e18e"
    np.testing.assert_allclose(
        full.uv[0, :5, 0].numpy(), [0.25160581, 0.87399584, 0.52791911, 0.69869286, 0.92643774], atol=1e-7
    )


def test_rand_ini_values(full: NoiseTables) -> None:
    expected = [
        0.0, 0.17098892, 0.16533190, 0.14378005, 0.76294738, 0.65893006, 0.02751905, 0.43482542, 0.05383557
    ]
    np.testing.assert_allclose(full.rand_ini[0].numpy(), expected, atol=1e-7)
    assert full.rand_ini[0, 0] == 0


def test_replay_equals_building_the_modules() -> None:
    """The draw-only replay consumes the RNG exactly as building the modules on the global RNG does."""
    cfg = _small()
    flow, hift = cfg.flow, cfg.hift
    with torch.random.fork_rng():
        torch.manual_seed(0)
        rand_noise = torch.randn(1, 80, flow.cfm.noise_frames)
        nn.Embedding(flow.vocab_size, flow.input_size)
        nn.Linear(flow.spk_embed_dim, flow.output_size)
        CausalConvRNNF0Predictor(hift.f0)
        rand_ini = torch.rand(1, 5)
        rand_ini[:, 0] = 0
        sine_waves = torch.rand(1, 24000, 5)
        nn.Linear(5, 1)
        uv = torch.rand(1, 24000, 1)
    tables = noise_tables(cfg)
    assert torch.equal(tables.flow_noise, rand_noise)
    assert torch.equal(tables.rand_ini, rand_ini)
    assert torch.equal(tables.sine_waves, sine_waves)
    assert torch.equal(tables.uv, uv)


def test_tables_follow_the_config() -> None:
    tables = noise_tables(_small())
    assert tables.flow_noise.shape == (1, 80, 100)
    assert tables.rand_ini.shape == (1, 5)
    assert tables.sine_waves.shape == (1, 24000, 5)
    assert tables.uv.shape == (1, 24000, 1)
    # The F0 predictor's size changes how much is drawn before the HiFT tables, hence their values.
    other = noise_tables(_small(cond_channels=16))
    assert torch.equal(other.flow_noise, tables.flow_noise)
    assert not torch.equal(other.sine_waves, tables.sine_waves)


def test_global_rng_is_untouched() -> None:
    state = torch.get_rng_state()
    noise_tables(_small())
    flow_noise(_small())
    assert torch.equal(torch.get_rng_state(), state)


def test_table_sha256_hashes_little_endian_float32_in_c_order() -> None:
    table = torch.tensor([[1.0, -2.0], [0.5, 3.0]]).t()  # non-contiguous: C order is 1, 0.5, -2, 3
    assert table_sha256(table) == hashlib.sha256(struct.pack("<4f", 1.0, 0.5, -2.0, 3.0)).hexdigest()


def test_sine_noise_is_drawn_exactly_from_its_mt19937_state(full: NoiseTables) -> None:
    """The runtime redraws torch's `sine_waves` from the stored state, bit for bit (upstream's full
    300 s table, and a small config whose draws start elsewhere in the generator's block)."""
    for tables in (full, noise_tables(_small())):
        table = tables.sine_waves.numpy()  # (1, S, H)
        noise = UniformNoise(tables.sine_waves_state, table.shape[1], table.shape[2])
        assert np.array_equal(noise.window(1000, 1240), table[:, 1000:1240])  # draws the prefix first
        assert np.array_equal(noise.window(0, table.shape[1]), table)
        assert noise.window(7, 7).shape == (1, 0, table.shape[2])
    with pytest.raises(ValueError, match="outside the table"):
        noise.window(0, table.shape[1] + 1)
    with pytest.raises(ValueError, match="625 uint32"):
        UniformNoise(tables.sine_waves_state[:-1], 10, 2)
