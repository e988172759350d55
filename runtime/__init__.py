"""Torch-free CosyVoice3 runtime (numpy + onnxruntime, TensorRT where a GPU is).

Never imports torch or `cosyvoice_export`.
"""
