"""The runtime bundle's tables (`bundle_layout`): the LLM's embedding rows, the flow noise, and the state
of the generator the sine noise is drawn from."""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path

import numpy as np

from cosyvoice_graphs import GraphSpec, ModelDims, spec
from cosyvoice_graphs.bundle_layout import (
    FLOW_NOISE,
    SINE_NOISE,
    SPEECH_EMBEDDING,
    TEXT_EMBEDDING,
    generated_table_file,
    table_file,
)
from cosyvoice_graphs.manifest import FileEntry, TableEntry
from cosyvoice_graphs.recipes import NOISE_TABLES
from cosyvoice_runtime.noise import MT19937, UniformNoise

from ..bundle.errors import BundleError
from ..bundle.model_dir import ModelBundle
from ..noise import noise_tables
from .lazy_networks import LazyNetworks
from .output_dir import install


def _max_size(s: GraphSpec, dim: str) -> int:
    return s.sizes({n: r.max for n, r in s.dims.items()})[dim]


def write_tables(out: Path, bundle: ModelBundle, nets: LazyNetworks, dims: ModelDims
                 ) -> tuple[dict[str, TableEntry], dict[str, FileEntry]]:
    """The lookup tables and flow noise as float32 .npy files, and the MT19937 state that the sine noise
    table is drawn from (checked to redraw torch's table bit for bit)."""
    llm = nets.llm
    noise = noise_tables(bundle.config)
    full = {FLOW_NOISE: noise.flow_noise, SINE_NOISE: noise.sine_waves}  # (1, mel, F), (1, S, H)
    axis = {FLOW_NOISE: 2, SINE_NOISE: 1}  # the time axis of each table
    tables: dict[str, tuple[np.ndarray, str]] = {
        TEXT_EMBEDDING: (llm.backbone.embed_tokens.weight.detach().numpy(),
                         "Qwen embed_tokens rows, by text token id"),
        SPEECH_EMBEDDING: (llm.speech_embedding.weight.detach().numpy(),
                           "speech_embedding rows, by speech id (sos, eos, task_id included)"),
    }
    for name, (graph, dim) in NOISE_TABLES.items():
        length = _max_size(spec(graph, dims), dim)
        table = full[name].numpy()
        cut = table[(slice(None),) * axis[name] + (slice(0, length),)]
        tables[name] = (cut, f"cut from {table.shape[axis[name]]} to {length} along axis {axis[name]}: "
                             f"{graph}'s profile allows at most {length} {dim}; read from 0")
    sine, sine_note = tables.pop(SINE_NOISE)
    info: dict[str, TableEntry] = {}
    files: dict[str, FileEntry] = {}
    for name, (array, note) in tables.items():
        rel = table_file(name)
        array = np.ascontiguousarray(array, dtype=np.float32)
        files[rel] = install(out, rel, partial(np.save, arr=array, allow_pickle=False))
        info[name] = TableEntry(rel, array.shape, "float32", note)
    drawn = UniformNoise(noise.sine_waves_state, sine.shape[1], sine.shape[2]).window(0, sine.shape[1])
    if not np.array_equal(drawn, sine):
        raise BundleError("the sine noise drawn from its MT19937 state differs from torch's table")
    rel = generated_table_file(SINE_NOISE)
    files[rel] = install(out, rel, partial(np.save, arr=noise.sine_waves_state, allow_pickle=False))
    info[SINE_NOISE] = TableEntry(
        rel, sine.shape, "float32", f"torch.rand's stream from this MT19937 state; {sine_note}",
        generator=MT19937, values_sha256=hashlib.sha256(sine.astype("<f4").tobytes()).hexdigest())
    return info, files
