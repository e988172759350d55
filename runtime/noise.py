"""Upstream's HiFT harmonic-noise table, made exactly from a saved MT19937 state instead of shipped.

Upstream draws `sine_waves = torch.rand(1, S, H)` once at construction (S = 300 s of samples, 259 MB at
full size). torch's CPU `rand` for float32 is serial: element i (row-major) is the i-th 32-bit output
of its MT19937 generator, masked to 24 bits and scaled by 2^-24. numpy's `MT19937` bit generator is the
same generator, so the runtime bundle stores only the state before the draw (624 words and a position)
and the runtime draws the prefix an utterance needs, bit-identical to upstream's table (the export
checks that against torch).
"""

from __future__ import annotations

import threading

import numpy as np

MT19937 = "mt19937"
"""The manifest's `generator` of a table stored as the state it is drawn from."""
MT19937_WORDS = 624
STATE_SIZE = MT19937_WORDS + 1
"""A stored state: the 624 key words, then numpy's position in them."""
_MANTISSA = np.uint64((1 << 24) - 1)
_SCALE = np.float32(2.0**-24)


class UniformNoise:
    """A float32 U[0, 1) table of shape (1, samples, harmonics), read by sample windows from 0 on.

    Values are drawn on first use and kept, so an utterance costs what its length needs; windows are
    safe to read from several threads.
    """

    def __init__(self, state: np.ndarray, samples: int, harmonics: int) -> None:
        """`state` is a stored MT19937 state (`STATE_SIZE` uint32: key, then position)."""
        state = np.asarray(state)
        if state.shape != (STATE_SIZE,) or state.dtype != np.uint32:
            raise ValueError(f"an MT19937 state is {STATE_SIZE} uint32 values, "
                             f"got {state.shape} {state.dtype}")
        if not 0 <= int(state[-1]) <= MT19937_WORDS:
            raise ValueError(f"MT19937 position must be in [0, {MT19937_WORDS}], got {int(state[-1])}")
        self.shape = (1, samples, harmonics)
        self._bits = np.random.MT19937()
        self._bits.state = {"bit_generator": "MT19937",
                            "state": {"key": state[:MT19937_WORDS], "pos": int(state[-1])}}
        self._values = np.zeros(0, dtype=np.float32)  # the first len() values of the flat table
        self._lock = threading.Lock()

    def window(self, start: int, stop: int) -> np.ndarray:
        """Samples [start, stop) of the table: (1, stop - start, harmonics) float32, a fresh array."""
        _, samples, harmonics = self.shape
        if not 0 <= start <= stop <= samples:
            raise ValueError(f"noise window [{start}, {stop}) is outside the table's {samples} samples")
        need = stop * harmonics
        with self._lock:
            if need > self._values.size:
                # Grow at least geometrically, so a stream's growing windows draw in O(n) in all.
                total = min(max(need, 2 * self._values.size), samples * harmonics)
                raw = self._bits.random_raw(total - self._values.size)  # 32-bit outputs, in uint64
                fresh = (raw & _MANTISSA).astype(np.float32) * _SCALE
                self._values = np.concatenate([self._values, fresh])
            values = self._values
        return values[start * harmonics:need].reshape(1, stop - start, harmonics).copy()
