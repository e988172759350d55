"""Torch-free CosyVoice3 runtime (numpy + onnxruntime, TensorRT where a GPU is).

`CosyVoice3` (also `AutoModel`, as upstream names it) is the front door. Never imports torch or
`cosyvoice_export`.
"""

from .cosyvoice3 import CosyVoice3

AutoModel = CosyVoice3
"""Upstream's name for the object that opens a model directory."""

__all__ = ["AutoModel", "CosyVoice3"]
