"""The layout of a runtime bundle (what `cosyvoice-export all` writes and the runtime reads).

    graphs/<name>.onnx       every graph of `SPECS`
    tables/<table>.npy       float32 lookup tables and the flow noise
    tables/sine_noise.mt19937.npy   the MT19937 state the HiFT noise table is drawn from (uint32)
    asset/zero_shot_prompt.{wav,txt}  the model bundle's demo prompt and transcript, when it has one
    frontend/                campplus.onnx, speech_tokenizer_v3.onnx
    tokenizer/               the CosyVoice-BlankEN tokenizer files and config.json
    cosyvoice3.yaml          the model's yaml, for provenance
    trt/<graph>.<key>.plan   TensorRT plans
    manifest.json            written last: files with sha256, graphs, model constants, validation
"""

from __future__ import annotations

FORMAT = "cosyvoice3-runtime-bundle"
FORMAT_VERSION = 3
"""3: the manifest's model section carries the HiFT layout (`cosyvoice_graphs.hift_layout`); 2: the sine
noise table is an MT19937 state (`cosyvoice_runtime.noise`); 1 shipped its values."""
MANIFEST = "manifest.json"
GRAPHS_DIR = "graphs"
TABLES_DIR = "tables"
FRONTEND_DIR = "frontend"
TOKENIZER_DIR = "tokenizer"
TRT_DIR = "trt"

TEXT_EMBEDDING = "text_embedding"
"""(text vocab, llm_hidden): Qwen's embed_tokens rows, by text token id."""
SPEECH_EMBEDDING = "speech_embedding"
"""(speech_vocab, llm_hidden): speech token rows, sos/eos/task_id/fill included."""
FLOW_NOISE = "flow_noise"
"""(1, mel_bins, frames): the flow's initial noise, read from the utterance's first frame."""
SINE_NOISE = "sine_noise"
"""(1, samples, harmonics): the NSF source's uniform noise, read from the utterance's first sample;
stored as the MT19937 state it is drawn from (`generated_table_file`)."""

RETIRED_GRAPHS = frozenset({"flow_estimator"})
"""Graphs that earlier exporters wrote and this one no longer does: an export into a folder that holds
them deletes their files (the bundles that list them are of format version 2). `flow_estimator` was the
one-shot DiT, which `flow_estimator_cached` with nothing cached computes bit for bit."""


def graph_file(name: str) -> str:
    return f"{GRAPHS_DIR}/{name}.onnx"


def table_file(name: str) -> str:
    return f"{TABLES_DIR}/{name}.npy"


def generated_table_file(name: str) -> str:
    """The MT19937 state a generated table is drawn from."""
    return f"{TABLES_DIR}/{name}.mt19937.npy"


MODEL_YAML = "cosyvoice3.yaml"
"""Upstream's model yaml: in a model bundle the model's definition, in a runtime bundle a copy of it."""
PROMPT_WAV = "asset/zero_shot_prompt.wav"
PROMPT_TEXT = "asset/zero_shot_prompt.txt"
"""The default prompt a bundle may carry: the model bundle's demo prompt and its transcript."""
QWEN_DIR = "CosyVoice-BlankEN"
"""A model bundle's Qwen2 folder: its config, weights and the tokenizer files a runtime bundle copies."""
