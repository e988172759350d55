"""Declarative contracts of the exported graphs: plain data, no torch, no onnxruntime."""
