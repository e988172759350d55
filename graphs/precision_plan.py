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

from .precision import BF16, EXACT_ON_CPU, FP32, INT4, INT8, PRECISIONS, Precision
from .recipes import RECIPES
from .registry import DIT, HIFT_DECODER, LLM, LLM_DECODE, LLM_PREFILL, OPTIONAL_SPECS, SPECS
from .spec import GraphSpec

GRAPH_ALIASES: dict[str, tuple[str, ...]] = {
    alias: tuple(r.name for r in RECIPES.values() if alias in r.aliases)
    for alias in dict.fromkeys(a for r in RECIPES.values() for a in r.aliases)}
"""Short names of graphs in `graph=precision` (`GraphRecipe.aliases`) -> the graphs each names, in pipeline
order (an alias may name several graphs: each takes the precision)."""

_CPU_FAST = {LLM: INT4.name, LLM_PREFILL: INT8.name, LLM_DECODE: INT4.name, DIT: INT8.name}
PROFILES: dict[str, dict[str, str]] = {
    # the fastest gated CPU bodies measured on the full-size random bundle (docs/performance-log.md)
    "cpu-fast": _CPU_FAST,
    # and HiFT's decoder in bf16 on OpenVINO, for CPUs with AVX512-BF16 or AMX (the DiT stays int8: its
    # streaming calls are slower in OpenVINO's bf16 than in onnxruntime's int8, measured on AMX)
    "cpu-fast-bf16": {**_CPU_FAST, HIFT_DECODER: BF16.name},
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
        order = (*SPECS, *OPTIONAL_SPECS)
        name = ",".join(f"{g}={graphs[g]}" for g in order if g in graphs)
        return cls(name, None, {g: graphs[g] for g in order if g in graphs})

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

    def check(self, specs: Mapping[str, GraphSpec]) -> None:
        """Refuse (one line) a graph given a precision its spec does not bound (an optional graph has a
        float32 body only where its recipe says so: `GraphRecipe.float32_optional`)."""
        for graph, precision in self.graphs.items():
            optional = graph in OPTIONAL_SPECS
            floats = ((FP32.name,) if RECIPES[graph].float32_optional else ()) if optional else EXACT_ON_CPU
            bounded = (*floats, *specs[graph].precision_tolerances)
            if precision not in bounded:
                note = " (an optional graph)" if optional else ""
                raise PrecisionPlanError(f"--precision {self.name}: {graph} has no {precision} body; its "
                                         f"spec bounds {', '.join(bounded)}{note}")


def _graph_keys() -> tuple[str, ...]:
    return (*SPECS, *OPTIONAL_SPECS, *GRAPH_ALIASES)
