"""ONNX (and TensorRT) export of the CosyVoice3 graphs declared in `cosyvoice_graphs`."""
