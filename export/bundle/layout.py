"""File names of upstream's model directory (one place for every reader and writer)."""

from __future__ import annotations

# The yaml, and our bundles' demo prompt and transcript (upstream's repository keeps its example prompt
# under the same name): the runtime bundle carries them at the same paths, so they are named once, there;
# the Qwen2 folder too, whose tokenizer the runtime reads before it exports a model bundle.
from cosyvoice_graphs.bundle_layout import MODEL_YAML as YAML
from cosyvoice_graphs.bundle_layout import PROMPT_TEXT, PROMPT_WAV, QWEN_DIR

__all__ = ["CAMPPLUS", "LLM_CHECKPOINTS", "LLM_VARIANTS", "PROMPT_TEXT", "PROMPT_WAV", "QWEN_DIR",
           "QWEN_WEIGHTS", "SPEECH_TOKENIZER", "SPK2INFO", "YAML"]

CAMPPLUS = "campplus.onnx"
SPEECH_TOKENIZER = "speech_tokenizer_v3.onnx"
SPK2INFO = "spk2info.pt"
QWEN_WEIGHTS = f"{QWEN_DIR}/model.safetensors"
"""Upstream's yaml builds the Qwen2 backbone from this before `llm.pt` overwrites every weight."""
LLM_CHECKPOINTS = {"base": "llm.pt", "rl": "llm.rl.pt"}
"""An LLM of the release -> its checkpoint file (`all --llm`). Upstream's loader reads `llm.pt`; the release
also ships `llm.rl.pt`, its reinforcement-learned LLM, with the same keys."""
LLM_VARIANTS = {**{llm: (file,) for llm, file in LLM_CHECKPOINTS.items()},
                "both": tuple(LLM_CHECKPOINTS.values())}
"""A `--llm` choice of `download` and `check-bundle` -> its LLM checkpoint files."""
