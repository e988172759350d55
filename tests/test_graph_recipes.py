"""Each graph's recipe (`cosyvoice_graphs.recipes`) and torch side (`cosyvoice_export.onnx.graphs`): one of
each per registered graph, every per-graph table keyed by known graphs, and none keyed by a literal outside
`graphs/`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cosyvoice_export.config import full_size
from cosyvoice_export.onnx.dims import model_dims
from cosyvoice_graphs import LLM, OPTIONAL_SPECS, REDUCED_PRECISIONS, SPECS, bundle_layout, spec
from cosyvoice_graphs.precision import FP16, INT4, INT8
from cosyvoice_graphs.precision_plan import GRAPH_ALIASES, PROFILES
from cosyvoice_graphs.recipes import NOISE_TABLES, RECIPES

ROOT = Path(__file__).resolve().parent.parent
GRAPHS = (*SPECS, *OPTIONAL_SPECS)
"""Every registered graph, in pipeline order."""
SCANNED = ("export", "runtime", "serve", "bench", "golden")
"""The packages that name graphs only by `cosyvoice_graphs`' constants."""
NETWORK_NAMES = frozenset({LLM})
"""Graph names that are also a network's (`--network llm`, llm.pt) and a timing key: a table keyed by one of
them alone may be of networks or stages, so the scan judges a table by its other keys."""


def test_every_graph_has_one_recipe_in_pipeline_order() -> None:
    assert tuple(RECIPES) == GRAPHS
    assert all(r.name == name for name, r in RECIPES.items())


def test_every_graph_has_one_export_recipe() -> None:
    pytest.importorskip("torch", reason="needs torch (the export extra)")
    from cosyvoice_export.onnx.graphs import EXPORT_RECIPES

    assert set(EXPORT_RECIPES) == set(GRAPHS)
    dims = model_dims(full_size())
    assert {n for n, r in EXPORT_RECIPES.items() if r.sequence is not None} == {
        n for n in GRAPHS if spec(n, dims).decode_gates}


def test_per_graph_tables_are_keyed_by_known_graphs() -> None:
    assert all(set(graphs) <= set(GRAPHS) for graphs in PROFILES.values())
    assert all(set(graphs) <= set(GRAPHS) for graphs in GRAPH_ALIASES.values())
    assert not set(GRAPH_ALIASES) & set(GRAPHS)  # an alias is never another graph's name
    assert GRAPH_ALIASES["hift"] == ("hift_f0", "hift_decoder")
    dims = model_dims(full_size())
    for table, (graph, dim) in NOISE_TABLES.items():
        assert table in (bundle_layout.FLOW_NOISE, bundle_layout.SINE_NOISE)
        s = spec(graph, dims)
        assert dim in s.dims or dim in s.derived, (table, graph, dim)


def test_a_recipe_has_a_body_exactly_where_its_spec_bounds_one() -> None:
    """fp16 scopes and quantization schemes: for exactly the precisions a spec bounds; a float32 body of an
    optional graph only where its recipe says."""
    dims = model_dims(full_size())
    for name, recipe in RECIPES.items():
        bounded = set(spec(name, dims).precision_tolerances)
        assert set(recipe.quantization) <= set(REDUCED_PRECISIONS), name
        assert (recipe.fp16_fp32_scopes is not None) == (FP16.name in bounded), name
        assert set(recipe.quantization) == bounded & {INT8.name, INT4.name}, name
        assert not recipe.float32_optional or name in OPTIONAL_SPECS, name


def _graph_keyed_tables(source: str) -> list[tuple[int, list[str]]]:
    """(line, graph names) of each dict or set display in `source` whose keys (elements) include a graph's
    name as a string literal, judged by the names that are only graphs' (`NETWORK_NAMES` apart)."""
    names = set(GRAPHS) - NETWORK_NAMES
    found = []
    for node in ast.walk(ast.parse(source)):
        keys = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, ast.Set) else []
        literals = {k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        if literals & names:
            found.append((node.lineno, sorted(literals & names)))
    return found


def test_the_scan_finds_tables_keyed_by_graph_name_literals() -> None:
    source = 'A = {"flow_encoder": 1, DIT: 2}\nB = {"llm": 3, "flow": 4}\nC = {"hift_f0", "x"}\n'
    assert _graph_keyed_tables(source) == [(1, ["flow_encoder"]), (3, ["hift_f0"])]


def test_no_table_outside_graphs_is_keyed_by_a_graph_name_literal() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {', '.join(names)}"
             for package in SCANNED for path in sorted((ROOT / package).rglob("*.py"))
             for line, names in _graph_keyed_tables(path.read_text(encoding="utf-8"))]
    assert not found, "key them by cosyvoice_graphs' graph name constants:\n" + "\n".join(found)
