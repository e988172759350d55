"""File names of upstream's model directory (one place for every reader and writer)."""

from __future__ import annotations

YAML = "cosyvoice3.yaml"
QWEN_DIR = "CosyVoice-BlankEN"
CAMPPLUS = "campplus.onnx"
SPEECH_TOKENIZER = "speech_tokenizer_v3.onnx"
SPK2INFO = "spk2info.pt"
QWEN_WEIGHTS = f"{QWEN_DIR}/model.safetensors"
"""Upstream's yaml builds the Qwen2 backbone from this before `llm.pt` overwrites every weight."""
PROMPT_WAV = "asset/zero_shot_prompt.wav"
"""Our bundles' demo prompt (upstream's repository keeps its example prompt under the same name)."""
PROMPT_TEXT = "asset/zero_shot_prompt.txt"
