"""PNG figures of a benchmark result, written beside its JSON (`--plots`): each stage's time against its
bound, and the first chunk's timeline stage by stage.

matplotlib is optional (the `dev` extra): `require_matplotlib` refuses in one line before anything is
measured, and it is imported only here, with its non-interactive Agg backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from cosyvoice_runtime.atomic_files import atomic_path
from cosyvoice_runtime.extras import install_command

from .errors import BenchError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOTS_EXTRA = "dev"
"""The extra that brings matplotlib."""


class Stage(NamedTuple):
    """One panel of the stages figure: a runtime figure and the keys of its case's `bounds`."""

    title: str
    figure: str
    bound: str
    fraction: str
    precision: str
    scale: float
    unit: str


STAGES = (
    Stage("LLM decode, per token", "llm_per_token_s", "llm_bound_s_per_token", "llm_fraction_runtime",
          "llm_precision", 1e3, "ms"),
    Stage("DiT, per ODE step", "flow_per_step_s", "dit_bound_s_per_step", "dit_fraction_runtime",
          "dit_precision", 1e3, "ms"),
    Stage("HiFT, whole case", "hift_s", "hift_bound_s", "hift_fraction_runtime", "hift_precision", 1.0, "s"),
)
TIMELINE = (("front end and rest", "#bbbbbb"), ("LLM", "#4c72b0"), ("flow", "#55a868"),
            ("vocoder", "#c44e52"))
"""The first chunk's stages in the order they run, and their colours."""


def require_matplotlib() -> None:
    """A `BenchError` naming the extra to install when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError(f"--plots needs matplotlib, which is not installed: {install_command(PLOTS_EXTRA)}"
                         ) from None


def plot_paths(json_out: Path) -> dict[str, Path]:
    """Where the figures of `--json OUT.json` go: OUT-stages.png and OUT-first-chunk.png beside it."""
    return {name: json_out.with_name(f"{json_out.stem}-{name}.png") for name in ("stages", "first-chunk")}


def write_plots(result: dict[str, Any], json_out: Path) -> list[Path]:
    """Draw `result` (the `--json` document) into `plot_paths(json_out)`, each written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = plot_paths(json_out)
    for name, draw in (("stages", _stages), ("first-chunk", _first_chunk)):
        figure = draw(result)
        try:
            with atomic_path(paths[name]) as tmp:
                figure.savefig(tmp, format="png", dpi=120)
        finally:
            plt.close(figure)
    return list(paths.values())


def _title(result: dict[str, Any]) -> str:
    m = result["machine"]
    return (f"{m['cpu']} ({m['cpu_class']}), {result['bundle']['path']} "
            f"({', '.join(sorted(set(result['bundle']['graph_precisions'].values())))})")


def _longest(result: dict[str, Any]) -> dict[str, Any]:
    case: dict[str, Any] = max(result["cases"], key=lambda c: c["pinned_tokens"])
    return case


def _stage_rows(result: dict[str, Any]) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    """(threads, the runtime's figures, its bounds) per thread count of the longest case: the thread
    scaling's rows, or the run's own threads alone."""
    if result["thread_scaling"]:
        return [(r["threads"], r, r["bounds"]) for r in result["thread_scaling"]["rows"]]
    case = _longest(result)
    return [(result["settings"]["threads"], case["runtime"], case["bounds"])]


def _stages(result: dict[str, Any]) -> Figure:
    """One panel per stage: the runtime's time beside its bound at each thread count, marked with the
    fraction of the bound reached."""
    import matplotlib.pyplot as plt

    rows = _stage_rows(result)
    figure, axes = plt.subplots(1, len(STAGES), figsize=(4.2 * len(STAGES), 4.2))
    for ax, stage in zip(axes, STAGES, strict=True):
        labels = [f"{threads} thread{'s' if threads > 1 else ''}" for threads, _, _ in rows]
        measured = [(figures[stage.figure] or 0.0) * stage.scale for _, figures, _ in rows]
        bound = [bounds[stage.bound] * stage.scale for _, _, bounds in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], measured, width=0.4, label="runtime", color="#4c72b0")
        ax.bar([i + 0.2 for i in x], bound, width=0.4, label="bound", color="#bbbbbb", hatch="//")
        for i, (_, _, bounds) in enumerate(rows):
            fraction = bounds[stage.fraction]
            if fraction is not None:
                ax.annotate(f"{fraction:.2f} of bound", (i - 0.2, measured[i]), ha="center", va="bottom",
                            fontsize=8)
        ax.set_title(f"{stage.title} ({rows[0][2][stage.precision]})", fontsize=10)
        ax.set_xticks(list(x), labels)
        ax.set_ylabel(stage.unit)
        ax.legend(fontsize=8)
    case = _longest(result)
    figure.suptitle(f"per-stage time against its bound, {case['length']} case\n{_title(result)}", fontsize=9)
    figure.tight_layout()
    return figure


def _first_chunk(result: dict[str, Any]) -> Figure:
    """The warm first chunk (cached prompt) from the request to its first samples, one bar per schedule
    and thread count, split into its stages in the order they run."""
    import matplotlib.pyplot as plt

    bars = []  # (label, total, [stage seconds in TIMELINE order])
    tokens = result["settings"]["first_chunk_tokens"]
    for threads, figures, _ in _stage_rows(result):
        schedules = [("upstream's schedule", "first_chunk_warm_cached_s", "first_chunk_")]
        if tokens is not None:
            schedules.append((f"first {tokens} tokens", "first_chunk_policy_warm_cached_s",
                              "first_chunk_policy_"))
        for name, total_key, prefix in schedules:
            total = figures[total_key]
            if total is None:
                continue
            stages = [figures[f"{prefix}{stage}_s"] or 0.0 for stage in ("llm", "flow", "vocoder")]
            bars.append((f"{name}, {threads} thr", total, [max(0.0, total - sum(stages)), *stages]))
    figure, ax = plt.subplots(figsize=(9, 1.6 + 0.6 * len(bars)), layout="constrained")
    for row, (_, total, stages) in enumerate(bars):
        left = 0.0
        for (stage, colour), seconds in zip(TIMELINE, stages, strict=True):
            ax.barh(row, seconds, left=left, color=colour, label=stage if row == 0 else None)
            left += seconds
        ax.annotate(f"{total:.2f} s", (total, row), xytext=(4, 0), textcoords="offset points", va="center",
                    fontsize=8)
    ax.set_yticks(range(len(bars)), [label for label, _, _ in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the request to the first samples")
    ax.set_xlim(0, max(total for _, total, _ in bars) * 1.15)
    figure.legend(fontsize=8, ncols=len(TIMELINE), loc="outside lower center")
    case = _longest(result)
    ax.set_title(f"first chunk, warm, cached prompt, {case['length']} case\n{_title(result)}", fontsize=9)
    return figure
