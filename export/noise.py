"""The fixed "random" tables upstream draws when it builds the model and never saves.

Upstream's `CausalConditionalCFM.__init__` reseeds the global RNG with 0 and draws the flow's initial noise;
the HiFT constructors then draw their tables from whatever state the RNG is in, so their values depend on
every draw in between. `noise_tables` replays that sequence on a private `torch.Generator` (the global RNG is
left alone), in the order hyperpyyaml builds the example `cosyvoice3.yaml`: nested `!new:` arguments first,
in document order.

1. CFM: seed 0, then `randn(1, mel, noise_frames)` (flow_matching.py, CausalConditionalCFM.__init__).
2. The rest of `CausalMaskedDiffWithDiT.__init__`: default init of `Embedding(vocab_size, input_size)`,
   then of `Linear(spk_embed_dim, output_size)` (flow.py).
3. `hift.f0_predictor` (a nested argument, so built before the generator): default init of its five convs
   and the classifier (f0_predictor.py); weight norm draws nothing.
4. `SineGen2.__init__`: `rand_ini = rand(1, H)` with column 0 zeroed, `sine_waves = rand(1, S, H)`.
5. `SourceModuleHnNSF.__init__`: default init of `Linear(H, 1)`, then `uv = rand(1, S, 1)`.

H = nb_harmonics + 1 and S = sampling_rate * noise_seconds (upstream writes 9 and 300 * 24000).
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from cosyvoice_export.config import ModelConfig
from cosyvoice_runtime.noise import MT19937_WORDS

SEED = 0
"""`CausalConditionalCFM.__init__` calls `set_all_random_seed(0)` before drawing its noise."""


@dataclass(frozen=True)
class NoiseTables:
    """Every construction-time random tensor of upstream's flow and HiFT (float32, CPU)."""

    flow_noise: Tensor
    """(1, mel, noise_frames) N(0, 1): the CFM's initial noise, read from frame 0 on."""
    rand_ini: Tensor
    """(1, H) U[0, 1) with column 0 zeroed: SineGen2's initial phase; it has no effect on the output."""
    sine_waves: Tensor
    """(1, S, H) U[0, 1): HiFT's harmonic noise, read from sample 0 on (the generator's `sine_noise`)."""
    uv: Tensor
    """(1, S, 1) U[0, 1): SourceModuleHnNSF's noise branch, which inference discards."""
    sine_waves_state: np.ndarray
    """The generator's MT19937 state just before `sine_waves` was drawn, as the runtime stores it
    (`cosyvoice_runtime.noise.STATE_SIZE` uint32: key, then numpy's position)."""


def _flow_noise(cfg: ModelConfig, gen: torch.Generator) -> Tensor:
    return torch.randn(1, cfg.flow.output_size, cfg.flow.cfm.noise_frames, generator=gen)  # (1, 80, 15000)


def _default_init(gen: torch.Generator, weight_shape: tuple[int, ...], bias_shape: tuple[int, ...]) -> None:
    """Consume what `nn.Linear` / `nn.Conv1d` `reset_parameters` draws for these shapes (values discarded)."""
    weight = torch.empty(weight_shape)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=gen)
    bound = 1 / math.sqrt(weight[0].numel())  # fan_in = in_features * kernel_size
    nn.init.uniform_(torch.empty(bias_shape), -bound, bound, generator=gen)


def flow_noise(cfg: ModelConfig) -> Tensor:
    """Seed 0, then randn(1, mel, noise_frames): the flow noise, equal to `noise_tables().flow_noise`."""
    return _flow_noise(cfg, torch.Generator().manual_seed(SEED))


def noise_tables(cfg: ModelConfig) -> NoiseTables:
    """Replay upstream's construction-time draws (see the module docstring) and return the tables.

    Draws about 72 M values at full size (a few hundred MB); the global RNG is not touched.
    """
    gen = torch.Generator().manual_seed(SEED)
    flow = cfg.flow
    noise = _flow_noise(cfg, gen)
    nn.init.normal_(torch.empty(flow.vocab_size, flow.input_size), generator=gen)  # input_embedding
    _default_init(gen, (flow.output_size, flow.spk_embed_dim), (flow.output_size,))  # spk_embed_affine_layer

    f0 = cfg.hift.f0
    _default_init(gen, (f0.cond_channels, f0.in_channels, 4), (f0.cond_channels,))  # condnet.0
    for _ in range(4):  # condnet.2, .4, .6, .8
        _default_init(gen, (f0.cond_channels, f0.cond_channels, 3), (f0.cond_channels,))
    _default_init(gen, (f0.num_class, f0.cond_channels), (f0.num_class,))  # classifier

    harmonics = cfg.hift.nb_harmonics + 1
    samples = cfg.hift.sampling_rate * cfg.hift.noise_seconds
    rand_ini = torch.rand(1, harmonics, generator=gen)
    rand_ini[:, 0] = 0
    sine_waves_state = mt19937_state(gen)
    sine_waves = torch.rand(1, samples, harmonics, generator=gen)
    _default_init(gen, (1, harmonics), (1,))  # m_source.l_linear
    uv = torch.rand(1, samples, 1, generator=gen)
    return NoiseTables(flow_noise=noise, rand_ini=rand_ini, sine_waves=sine_waves, uv=uv,
                       sine_waves_state=sine_waves_state)


def mt19937_state(gen: torch.Generator) -> np.ndarray:
    """A CPU generator's MT19937 state in numpy's terms: 624 key words, then the position of the next one.

    torch's state is its `CPUGeneratorImplState` struct: seed (u64), `left` (i32), `seeded` (i32),
    `next` (u64), the 624 words (u64 each), then normal-sampling fields. It emits word `next` unless
    `left` is 1, when it regenerates first, which is numpy's position 624.
    """
    raw = gen.get_state().numpy().tobytes()
    left, _seeded, position = struct.unpack_from("<iiQ", raw, 8)
    key = np.frombuffer(raw, dtype="<u8", count=MT19937_WORDS, offset=24)
    if key.max() >= 1 << 32 or not 1 <= left <= MT19937_WORDS:
        raise ValueError("unexpected torch CPU generator state layout")
    return np.append(key, MT19937_WORDS if left == 1 else position).astype(np.uint32)


def table_sha256(table: Tensor) -> str:
    """sha256 (hex) of a table's raw little-endian float32 bytes in C order: the form in which the
    tests pin upstream's own tables."""
    array = table.detach().to("cpu", torch.float32).contiguous().numpy()
    return hashlib.sha256(array.astype("<f4", copy=False).data).hexdigest()
