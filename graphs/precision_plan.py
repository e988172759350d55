"""What `--precision` asks of a runtime bundle: the precision of each of its graphs.

It names one of three things:

- a precision (`PRECISIONS`): each graph whose spec bounds it gets a body in it, the others stay fp32;
- a profile (`PROFILES`): a named precision per graph, the others fp32;
- `graph=precision,...`: each graph named (by its name, or an alias of `GRAPH_ALIASES`) in that precision,
  which its spec must bound; the others fp32.

An optional graph (`OPTIONAL_SPECS`: `llm_prefill`, `llm_decode`) is in the bundle only where a profile or a
list names it, in a reduced precision or, where it has a float32 body (`GraphRecipe.float32_optional`), in
fp32.

The manifest records the plan's `name` as the bundle's precision and each graph's own precision beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .precision import BF16, EXACT_ON_CPU, FP16, FP32, INT4, INT8, PRECISIONS, Precision
from .recipes import RECIPES
from .registry import DIT, FLOW_ENCODER, HIFT_DECODER, LLM, LLM_DECODE, LLM_PREFILL, OPTIONAL_SPECS, SPECS
from .spec import GraphSpec

GRAPH_ALIASES: dict[str, tuple[str, ...]] = {
    alias: tuple(r.name for r in RECIPES.values() if alias in r.aliases)
    for alias in dict.fromkeys(a for r in RECIPES.values() for a in r.aliases)}
"""Short names of graphs in `graph=precision` (`GraphRecipe.aliases`) -> the graphs each names, in pipeline
order (an alias may name several graphs: each takes the precision)."""

GPU_FP16 = "gpu-fp16"
"""The profile of onnxruntime's CUDA provider in float16 (`PROFILES`)."""

_CPU_FAST = {LLM: INT4.name, LLM_PREFILL: INT8.name, LLM_DECODE: INT4.name, DIT: INT8.name}
PROFILES: dict[str, dict[str, str]] = {
    # the fastest gated CPU bodies measured on the full-size random bundle (docs/performance-log.md)
    "cpu-fast": _CPU_FAST,
    # and HiFT's decoder in bf16 on OpenVINO, for CPUs with AVX512-BF16 or AMX (the DiT stays int8: its
    # streaming calls are slower in OpenVINO's bf16 than in onnxruntime's int8, measured on AMX)
    "cpu-fast-bf16": {**_CPU_FAST, HIFT_DECODER: BF16.name},
    # every graph with an fp16 body in fp16, and the decode steps on an fp16 llm_decode: the CUDA provider
    # decodes there (an fp16 llm's growing caches fail in onnxruntime's CUDA GroupQueryAttention)
    GPU_FP16: {LLM: FP16.name, LLM_DECODE: FP16.name, FLOW_ENCODER: FP16.name, DIT: FP16.name,
               HIFT_DECODER: FP16.name},
}
"""Named precisions per graph (graphs not named are fp32)."""


class PrecisionPlanError(ValueError):
    """`--precision` names something unknown, or a precision a graph's spec does not bound: one line."""


@dataclass(frozen=True)
class PrecisionPlan:
    """The precision of each graph of a bundle, as `--precision` asks for it (`parse`)."""

    name: str
    """What the manifest records as the bundle's precision: the precision or profile name, or
    `graph=precision,...` with the graphs' full names in pipeline order."""
    bundle: str | None
    """The precision named for the whole bundle; None for a profile or a list."""
    graphs: Mapping[str, str] = field(default_factory=dict)
    """Graph -> its precision, for the graphs a profile or a list names."""
    aliased: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Graph -> the alias (`GRAPH_ALIASES`) that named it in a list, for the graphs named so (how the plan was
    spelt, not what it is: not compared)."""

    @classmethod
    def parse(cls, text: str) -> PrecisionPlan:
        """The plan `text` names; a one-line `PrecisionPlanError` naming what is unknown and the known
        ones."""
        text = text.strip()
        if "=" not in text:
            if text in PRECISIONS:
                return cls(text, text)
            if text in PROFILES:
                return cls(text, None, PROFILES[text])
            raise PrecisionPlanError(
                f"--precision: unknown precision or profile {text!r}; known: {', '.join(PRECISIONS)}, "
                f"{', '.join(PROFILES)}, or graph=precision,... (graphs: {', '.join(_graph_keys())})")
        graphs: dict[str, str] = {}
        aliased: dict[str, str] = {}
        for item in text.split(","):
            key, sep, precision = (part.strip() for part in item.partition("="))
            if not sep or not key or not precision:
                raise PrecisionPlanError(f"--precision: {item.strip()!r} is not graph=precision")
            if key not in SPECS and key not in OPTIONAL_SPECS and key not in GRAPH_ALIASES:
                raise PrecisionPlanError(f"--precision: unknown graph {key!r}; known: "
                                         f"{', '.join(_graph_keys())}")
            if precision not in PRECISIONS:
                raise PrecisionPlanError(f"--precision: {key}={precision}: unknown precision {precision!r}; "
                                         f"known: {', '.join(PRECISIONS)}")
            for graph in GRAPH_ALIASES.get(key, (key,)):
                if graph in graphs:
                    raise PrecisionPlanError(f"--precision: {graph} is given a precision twice")
                graphs[graph] = precision
                if key in GRAPH_ALIASES:
                    aliased[graph] = key
        order = (*SPECS, *OPTIONAL_SPECS)
        name = ",".join(f"{g}={graphs[g]}" for g in order if g in graphs)
        return cls(name, None, {g: graphs[g] for g in order if g in graphs}, aliased)

    @property
    def named(self) -> tuple[Precision, ...]:
        """The precisions the plan names (what `--trt` and the CPU's instructions are checked against before
        anything is read: a graph given none of them is fp32)."""
        names = (self.bundle,) if self.bundle is not None else tuple(dict.fromkeys(self.graphs.values()))
        return tuple(PRECISIONS[n] for n in names)

    @property
    def graph_names(self) -> tuple[str, ...]:
        """The graphs of a bundle of this plan: `SPECS` in pipeline order, then the optional ones it names."""
        return (*SPECS, *(g for g in OPTIONAL_SPECS if g in self.graphs))

    def precision_of(self, s: GraphSpec) -> str:
        """The name of graph `s`'s precision under this plan."""
        if self.bundle is not None:
            return s.precision_in(self.bundle)
        return self.graphs.get(s.name, FP32.name)

    def precisions(self, specs: Mapping[str, GraphSpec]) -> dict[str, Precision]:
        """Each graph of a bundle of this plan (`graph_names`, `specs` holding each one's spec) -> its
        precision, in pipeline order: what `cosyvoice_graphs.pipeline` reads. It follows the specs' bounds
        (`precision_of`), which a model's size does not change."""
        return {name: PRECISIONS[self.precision_of(specs[name])] for name in self.graph_names}

    def check(self, specs: Mapping[str, GraphSpec]) -> None:
        """Refuse (one line) a graph given a precision its spec does not bound (an optional graph has a
        float32 body only where its recipe says so: `GraphRecipe.float32_optional`)."""
        for graph, precision in self.graphs.items():
            bounded = _bounded(graph, specs)
            if precision not in bounded:
                note = " (an optional graph)" if graph in OPTIONAL_SPECS else ""
                raise PrecisionPlanError(f"--precision {self.name}: {graph} has no {precision} body; its "
                                         f"spec bounds {', '.join(bounded)}{note}"
                                         f"{self._alias_hint(graph, specs)}")

    def _alias_hint(self, graph: str, specs: Mapping[str, GraphSpec]) -> str:
        """For a graph an alias of several named: which of the alias's graphs have a body in its
        precision, to name alone."""
        alias, precision = self.aliased.get(graph), self.graphs[graph]
        if alias is None or len(GRAPH_ALIASES[alias]) < 2:
            return ""
        members = GRAPH_ALIASES[alias]
        having = [g for g in members if g in specs and precision in _bounded(g, specs)]
        names = " and ".join(members)
        if not having:
            return f" ({alias} names {names}; none has one)"
        return f" ({alias} names {names}: give {','.join(f'{g}={precision}' for g in having)} alone)"


def _bounded(graph: str, specs: Mapping[str, GraphSpec]) -> tuple[str, ...]:
    """The precisions `graph` can be given: its spec's, and the float32 ones (an optional graph only where
    its recipe has a float32 body: `GraphRecipe.float32_optional`)."""
    if graph in OPTIONAL_SPECS:
        floats: tuple[str, ...] = (FP32.name,) if RECIPES[graph].float32_optional else ()
    else:
        floats = EXACT_ON_CPU
    return (*floats, *specs[graph].precision_tolerances)


def _graph_keys() -> tuple[str, ...]:
    return (*SPECS, *OPTIONAL_SPECS, *GRAPH_ALIASES)
