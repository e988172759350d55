"""The precisions a runtime bundle is exported in, one record each: what it is for, whether the exporter
rewrites the float32 graph, and where its graphs run. The exporter, the runtime, golden and bench consult
the record; a new precision is a record here plus its conversion in the exporter
(`cosyvoice_export.onnx.conversions.CONVERSIONS`).

Each graph of a bundle has one precision, which its spec must bound (`GraphSpec.precision_tolerances`);
`cosyvoice_graphs.precision_plan` says which, from what `--precision` names. Graph I/O is the spec's in every
precision, but where a spec gives a body other dtypes (`GraphSpec.precision_dtypes`: the float16 caches of the
fp16 `llm_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .providers import CPU, CPU_PROVIDERS, CUDA, OPENVINO, PROVIDERS, TENSORRT, TRT


@dataclass(frozen=True)
class Precision:
    """One precision: what it is for, how its graphs are made, and where they run."""

    name: str
    """As `--precision`, the manifest and a graph's `precision` metadata spell it."""
    purpose: str
    """What it is for, in one line (read after "is for")."""
    rewrite: str | None
    """How the exporter rewrites the exported float32 graph into it; None when its graph is the float32
    export itself (fp32; tf32, whose math the CUDA provider changes, its DiT written for onnxruntime; bf16,
    which OpenVINO converts as it compiles the graph)."""
    cpu_provider: str
    """What validates its graphs at export and runs them under `cpu`: onnxruntime (`cpu`) or OpenVINO
    (`openvino`)."""
    openvino_hint: str | None
    """OpenVINO's `INFERENCE_PRECISION_HINT` for its graphs; None when OpenVINO does not run them."""
    providers: tuple[str, ...]
    """The providers its graphs may run on; `trt` among them when the exporter builds TensorRT plans of
    them."""
    runs_on: str
    """Where its graphs run, in the words of a refusal."""
    weight_bytes: float
    """Bytes per weight of its matmuls (int8, int4: their scales and float32 heads not counted)."""
    cuda_tf32: bool = False
    """Whether onnxruntime's CUDA provider runs its float32 matmuls and convolutions in TF32 (inputs rounded
    to a 10-bit mantissa; the provider's own default, which every other precision turns off)."""

    def __post_init__(self) -> None:
        unknown = [p for p in self.providers if p not in PROVIDERS]
        if unknown:
            raise ValueError(f"{self.name}: unknown provider {unknown[0]!r}; known: {', '.join(PROVIDERS)}")
        if self.cpu_provider not in CPU_PROVIDERS or CPU not in self.providers:
            raise ValueError(f"{self.name}: must run under `cpu`, through one of {', '.join(CPU_PROVIDERS)}")
        if (self.openvino_hint is None) == (OPENVINO in self.providers):
            raise ValueError(f"{self.name}: an OpenVINO hint exactly when it runs on {OPENVINO!r}")
        if self.cuda_tf32 and self.rewrite is not None:
            raise ValueError(f"{self.name}: TF32 is the math of a float32 graph, not of a rewritten one")

    @property
    def exact_on_cpu(self) -> bool:
        """Whether its graphs are the float32 export, computed in float32 on the CPU (fp32, tf32): a spec's
        fp32 bounds validate them there, and no spec bounds them apart."""
        return self.rewrite is None and self.cpu_provider == CPU

    def onnxruntime_only(self, *, trt_plans: bool, float32_cuda_form: bool = False) -> bool:
        """Whether its graphs, in an export that builds TensorRT plans of them (`trt_plans`, `--trt`) or not,
        run on onnxruntime alone, so that their export may be written for it: its own operators (its
        `com.microsoft` domain) and the forms its kernels run fastest. Rewritten graphs never run on
        OpenVINO; int8's and int4's never as TensorRT plans, fp16's only from an export that builds them
        (onnxruntime's TensorRT provider would leave onnxruntime's operators to its CUDA provider: not run
        here). Of the float32 exports, fp32's graphs run everywhere and bf16's on OpenVINO; tf32's run on
        onnxruntime's CPU and CUDA providers alone, so a graph whose form for onnxruntime the CUDA provider
        computes in float32 (`float32_cuda_form`: its `GraphRecipe.float32_cuda_form`) takes that form."""
        if self.rewrite is None:
            return float32_cuda_form and self.cpu_provider == CPU and set(self.providers) <= {CPU, CUDA}
        return (self.cpu_provider == CPU and OPENVINO not in self.providers
                and not (trt_plans and self.trt_plans))

    @property
    def trt_plans(self) -> bool:
        """Whether the exporter builds TensorRT plans of its graphs (`--trt`)."""
        return TRT in self.providers

    @staticmethod
    def named(name: str) -> Precision:
        """The precision called `name`; a one-line `ValueError` naming the known ones otherwise."""
        found = PRECISIONS.get(name) if isinstance(name, str) else None
        if found is None:
            raise ValueError(f"unknown precision {name!r}; known: {', '.join(PRECISIONS)}")
        return found


FP32 = Precision(
    "fp32", "the reference: every graph as traced, on every provider", rewrite=None, cpu_provider=CPU,
    openvino_hint="f32", providers=PROVIDERS, runs_on="every provider", weight_bytes=4)
"""Also the precision of a graph whose manifest entry or metadata records none."""
FP16 = Precision(
    "fp16", "GPUs: float16 weights and matmuls, half the memory and traffic",
    rewrite="float16 weights and matmul/conv compute; numerically fragile ops and the I/O in float32 (but "
            "the float16 caches of llm_decode's)",
    cpu_provider=CPU, openvino_hint=None, providers=(CPU, CUDA, TENSORRT, TRT),
    runs_on="onnxruntime and TensorRT", weight_bytes=2)
INT8 = Precision(
    "int8", "CPUs: int8 weights for the llm's and the DiT's matmuls",
    rewrite="int8 weights for the weight matmuls (onnxruntime's MatMulNBits or dynamic quantization); "
            "caches, norms, softmax, heads and the I/O in float32",
    cpu_provider=CPU, openvino_hint=None, providers=(CPU, CUDA, TENSORRT),
    runs_on="onnxruntime (int8 operators, which TensorRT does not build)", weight_bytes=1)
INT4 = Precision(
    "int4", "CPUs: 4-bit weights for the llm's matmuls, half of int8's bytes per decoded token",
    rewrite="4-bit weights for the llm's weight matmuls (onnxruntime's MatMulNBits, int8 activations); "
            "caches, norms, softmax, the output head and the I/O in float32",
    cpu_provider=CPU, openvino_hint=None, providers=(CPU, CUDA, TENSORRT),
    runs_on="onnxruntime (4-bit operators, which TensorRT does not build)", weight_bytes=0.5)
BF16 = Precision(
    "bf16", "CPUs with AVX512-BF16 or AMX: the DiT and HiFT's decoder computed in bfloat16, by OpenVINO",
    rewrite=None, cpu_provider=OPENVINO, openvino_hint="bf16", providers=(CPU, OPENVINO),
    runs_on="the CPU (OpenVINO)", weight_bytes=2)

TF32 = Precision(
    "tf32", "GPUs: the float32 graphs with TF32 matmuls and convolutions on CUDA's tensor cores",
    rewrite=None, cpu_provider=CPU, openvino_hint=None, providers=(CPU, CUDA),
    runs_on="onnxruntime's CPU (as fp32) and CUDA providers", weight_bytes=4, cuda_tf32=True)
"""Judged on a GPU by golden's tf32 bounds. On the CPU it computes as fp32: every graph but the DiT is fp32's
to the byte, and the DiT, in onnxruntime's attention and rotary operators, within float32's rounding of
fp32's (`onnxruntime_only`)."""

PRECISIONS: dict[str, Precision] = {p.name: p for p in (FP32, FP16, INT8, INT4, BF16, TF32)}
"""Every precision by name (iterating gives the names, as `--precision` lists them)."""
PRECISION_NAMES = tuple(PRECISIONS)
EXACT_ON_CPU = tuple(name for name, p in PRECISIONS.items() if p.exact_on_cpu)
"""The precisions whose body is the float32 export, validated with a spec's fp32 bounds (fp32, tf32)."""
REDUCED_PRECISIONS = tuple(name for name in PRECISIONS if name not in EXACT_ON_CPU)
"""The precisions a spec may bound (`GraphSpec.precision_tolerances`): validated against float32."""


def precisions_on(provider: str) -> tuple[str, ...]:
    """The names of the precisions whose graphs may run on `provider`."""
    return tuple(name for name, p in PRECISIONS.items() if provider in p.providers)
