"""Where a graph runs: the runtime's provider names, shared by the exporter, the runtime and the tools."""

from __future__ import annotations

CPU, CUDA, TENSORRT, TRT, OPENVINO = "cpu", "cuda", "tensorrt", "trt", "openvino"
PROVIDERS = (CPU, CUDA, TENSORRT, TRT, OPENVINO)
"""`cpu`, `cuda`, `tensorrt`: onnxruntime and its execution provider; `trt`: the bundle's TensorRT plans;
`openvino`: OpenVINO's CPU plugin. bf16 graphs run on OpenVINO under `cpu` too: it is the only CPU
runtime here that computes in bf16."""
CPU_PROVIDERS = (CPU, OPENVINO)
"""The providers that run a graph on the CPU (where bf16 graphs run)."""
