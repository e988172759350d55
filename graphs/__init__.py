"""Declarative contracts of the exported graphs: plain data, no torch, no onnxruntime."""

from .registry import SPECS, ModelDims, metadata, spec, time_sinusoid
from .spec import (
    PRECISIONS,
    Case,
    DecodeGates,
    DerivedDim,
    DimRange,
    GraphSpec,
    SolveGates,
    TensorSpec,
    Tolerance,
    cache_pairs,
    empty_caches,
)

__all__ = ["PRECISIONS", "SPECS", "Case", "DecodeGates", "DerivedDim", "DimRange", "GraphSpec", "ModelDims",
           "SolveGates", "TensorSpec", "Tolerance", "cache_pairs", "empty_caches", "metadata", "spec",
           "time_sinusoid"]
