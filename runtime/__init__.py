"""Torch-free CosyVoice3 runtime (numpy + onnxruntime, TensorRT where a GPU is).

`CosyVoice3` (also `AutoModel`, as upstream names it) is the front door. Never imports torch or
`cosyvoice_export`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .audio_files import save_wav
    from .cosyvoice3 import CosyVoice3

    AutoModel = CosyVoice3

__all__ = ["AutoModel", "CosyVoice3", "save_wav"]


def __getattr__(name: str) -> Any:
    # imported on first use, so that `cosyvoice_runtime.extras` (the console scripts' front) loads where
    # onnxruntime is missing; `AutoModel` is upstream's name for the object that opens a model directory
    if name in ("AutoModel", "CosyVoice3"):
        try:
            from .cosyvoice3 import CosyVoice3
        except ModuleNotFoundError as e:
            from .extras import missing_extra_line

            line = missing_extra_line("cosyvoice_runtime", e, ())
            if line is None:
                raise
            raise ModuleNotFoundError(line.removeprefix("error: "), name=e.name) from None
        return CosyVoice3
    if name == "save_wav":  # torchaudio.save's stand-in for upstream's example
        from .audio_files import save_wav

        return save_wav
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
