"""Read HyperPyYAML files (upstream's `cosyvoice3.yaml`) as plain data, without importing or running anything.

HyperPyYAML builds Python objects while it loads: `!new:pkg.Class` instantiates, `!name:pkg.func` makes a
partial, `!apply:pkg.func` calls. Here those nodes become `Tagged` values that only record what the file
says, so reading a bundle's hyperparameters needs neither torch nor upstream's code. What is kept from
HyperPyYAML's semantics:

- `!ref <key>` and `!copy <key>` resolve against the document after `overrides` are merged in; `<a[b]>`
  walks into nested mappings (including the arguments of a tagged node) and `<a.attr>` becomes
  `Tagged("apply", "getattr", [value, "attr"])`, as HyperPyYAML does.
- A reference that is the whole expression keeps the referenced value's type; otherwise each `<key>` is
  replaced by its text and the result is evaluated as arithmetic (numbers with `+ - * / // % **`) when it
  parses as such, else kept as a string (`<dir>/sub`). Unary operators are not arithmetic there, so
  `-<a>` stays a string; we match that.
- Plain scalars like `(3, 4)` are tuples; scalars follow YAML 1.2 (`1e-06` is a float, `yes` a string),
  because HyperPyYAML's first pass reads the file with ruamel.yaml.

Differences: top-level keys starting with `__` are kept (HyperPyYAML drops them after running them), a
reference is resolved to the fully resolved target wherever the target sits in the file, and `!include:`
is refused. As in HyperPyYAML, a `!PLACEHOLDER` that no override replaces is an error.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import BundleError

# Tag prefixes whose suffix is a dotted Python name; `Tagged.kind` is the prefix without `!` and `:`.
CALLABLE_KINDS = ("new", "name", "apply", "applyref", "module")


@dataclass(frozen=True)
class Tagged:
    """A tagged node: `!new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT` + its arguments.

    `kind` is one of `CALLABLE_KINDS`, or `"tag"` for any other tag (then `target` is the whole tag).
    `args` is a dict for a mapping node, a list for a sequence node, the value for a non-empty scalar,
    and `{}` for an empty one.
    """

    kind: str
    target: str
    args: Any = field(default_factory=dict)

    def is_call(self, kind: str, target: str) -> bool:
        """Whether this node is `!kind:target`."""
        return self.kind == kind and self.target == target

    @property
    def tag(self) -> str:
        """The tag as written in the file."""
        return self.target if self.kind == "tag" else f"!{self.kind}:{self.target}"


@dataclass(frozen=True)
class _Ref:
    """An unresolved `!ref`/`!copy` expression; never escapes this module."""

    expr: str


_UNSUPPORTED_TAGS = ("!include:", "!PLACEHOLDER")
_REF_PATTERN = re.compile(r"<[^>]*>")
_DECIMAL = re.compile(r"^[-+]?[0-9]+$")

KeyPath = tuple[str | int, ...]


def key_name(path: Sequence[str | int]) -> str:
    """`("flow", "decoder", "estimator")` -> `"flow.decoder.estimator"`, the form used in error messages."""
    return ".".join(str(p) for p in path) or "<document>"


# --- loading -------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars and HyperPyYAML tags turned into data."""


# Replace PyYAML's YAML 1.1 implicit types (yes/no booleans, sexagesimal numbers, timestamps, dot-less
# floats as strings) with YAML 1.2's, which is what HyperPyYAML's ruamel.yaml pass sees.
_Loader.yaml_implicit_resolvers = {}
_Loader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"),
                              ["~", "n", "N", ""])
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:int",
                              re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
               r"|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"),
)
_Loader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])
_Loader.add_implicit_resolver("!tuple", re.compile(r"^\(.*\)$"), ["("])


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    # YAML 1.2: `010` is ten; only `0o`/`0x` change the base.
    return int(text, 10) if _DECIMAL.match(text) else int(text, 0)


def _construct_float(loader: _Loader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node).lower()
    return float(text.replace(".inf", "inf").replace(".nan", "nan"))


def _construct_tuple(loader: _Loader, node: yaml.ScalarNode) -> tuple[Any, ...]:
    text = loader.construct_scalar(node)
    return tuple(yaml.load("[" + text[1:-1] + "]", Loader=_Loader))


def _construct_ref(loader: _Loader, node: yaml.Node) -> _Ref:
    if not isinstance(node, yaml.ScalarNode):
        raise yaml.constructor.ConstructorError(None, None, f"{node.tag} needs a scalar <key>",
                                                node.start_mark)
    return _Ref(loader.construct_scalar(node))


def _node_value(loader: _Loader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    text = loader.construct_scalar(node)
    return text if text != "" else {}


def _tagged_constructor(kind: str) -> Callable[[_Loader, str, yaml.Node], Tagged]:
    def construct(loader: _Loader, suffix: str, node: yaml.Node) -> Tagged:
        return Tagged(kind, suffix, _node_value(loader, node))

    return construct


def _construct_other(loader: _Loader, tag: str, node: yaml.Node) -> Tagged:
    return Tagged("tag", tag, _node_value(loader, node))


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_Loader.add_constructor("!tuple", _construct_tuple)
_Loader.add_constructor("!ref", _construct_ref)
_Loader.add_constructor("!copy", _construct_ref)
for _kind in CALLABLE_KINDS:
    _Loader.add_multi_constructor(f"!{_kind}:", _tagged_constructor(_kind))
# Last, so the specific prefixes above win: any other tag (`!PLACEHOLDER`, `!!python/...`) becomes data.
_Loader.add_multi_constructor("", _construct_other)


# --- arithmetic ----------------------------------------------------------------------------------------

_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_MAX_EXPONENT = 1024  # refuse `<a> ** 10**9`-style expressions that would hang the reader


class _NotArithmetic(Exception):
    pass


def _eval_node(node: ast.expr) -> int | float:
    if (isinstance(node, ast.Constant) and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ArithmeticError(f"exponent {right} is too large")
        return _BINOPS[type(node.op)](left, right)
    raise _NotArithmetic


def _arithmetic(text: str) -> Any:
    """The value of `text` if it is arithmetic on number literals, else `text` unchanged."""
    try:
        return _eval_node(ast.parse(text, mode="eval").body)
    except (SyntaxError, _NotArithmetic):
        return text


# --- overrides and references --------------------------------------------------------------------------


def _children(node: Any) -> dict[Any, Any] | list[Any] | None:
    """The container a path step indexes into: a mapping or sequence, or a tagged node's arguments."""
    if isinstance(node, Tagged):
        node = node.args
    return node if isinstance(node, dict | list) else None


def _merge(node: Any, overrides: Mapping[str, Any], path: KeyPath, source: str) -> None:
    """Nested update in the manner of HyperPyYAML's `recursive_update` (new keys are added)."""
    target = _children(node)
    if not isinstance(target, dict):
        raise BundleError(f"{source}: override for key '{key_name(path)}' is a mapping but the file "
                          f"has {type(node).__name__} there")
    for key, value in overrides.items():
        if isinstance(value, Mapping) and key in target:
            _merge(target[key], value, (*path, key), source)
        else:
            target[key] = value


class _Resolver:
    """Resolves every `!ref` in a loaded document, memoised per key path so shared targets stay shared."""

    def __init__(self, root: dict[str, Any], source: str) -> None:
        self.root = root
        self.source = source
        self.done: dict[KeyPath, Any] = {}
        self.active: list[KeyPath] = []

    def fail(self, path: KeyPath, message: str) -> BundleError:
        return BundleError(f"{self.source}: key '{key_name(path)}': {message}")

    def raw(self, path: KeyPath) -> Any:
        node: Any = self.root
        for step in path:
            container = _children(node)
            if isinstance(container, dict) and step in container:
                node = container[step]
            elif isinstance(container, list) and isinstance(step, int):
                node = container[step]
            else:
                raise KeyError(step)
        return node

    def value(self, path: KeyPath) -> Any:
        if path in self.done:
            return self.done[path]
        if path in self.active:
            cycle = " -> ".join(key_name(p) for p in self.active[self.active.index(path):])
            raise self.fail(path, f"circular reference ({cycle} -> {key_name(path)})")
        self.active.append(path)
        resolved = self.resolve(self.raw(path), path)
        self.active.pop()
        self.done[path] = resolved
        return resolved

    def resolve(self, node: Any, path: KeyPath) -> Any:
        if isinstance(node, _Ref):
            return self.expression(node.expr, path)
        if isinstance(node, dict):
            return {key: self.value((*path, key)) for key in node}
        if isinstance(node, list):
            return [self.value((*path, i)) for i in range(len(node))]
        if isinstance(node, Tagged):
            if node.kind == "tag" and node.target.startswith(_UNSUPPORTED_TAGS):
                raise self.fail(path, f"{node.target} must be overridden or inlined; it is not supported")
            return Tagged(node.kind, node.target, self.resolve(node.args, path))
        return node

    def deref(self, name: str, path: KeyPath) -> Any:
        ref, _, attr = name.partition(".")
        target = tuple(part.strip("]") for part in ref.split("["))
        try:
            self.raw(target)
        except KeyError:
            raise self.fail(path, f"reference <{name}> does not name a key of the file") from None
        found = self.value(target)
        return Tagged("apply", "getattr", [found, attr]) if attr else found

    def expression(self, expr: str, path: KeyPath) -> Any:
        if not _REF_PATTERN.search(expr):
            return expr  # HyperPyYAML evaluates arithmetic only in expressions that hold a reference
        if _REF_PATTERN.fullmatch(expr):
            return self.deref(expr[1:-1], path)

        def substitute(match: re.Match[str]) -> str:
            found = self.deref(match.group(0)[1:-1], path)
            if isinstance(found, dict | list | tuple | Tagged):
                raise self.fail(path, f"reference {match.group(0)} in '{expr}' is not a scalar")
            return str(found)

        text = _REF_PATTERN.sub(substitute, expr)
        try:
            return _arithmetic(text)
        except ArithmeticError as e:
            raise self.fail(path, f"cannot evaluate '{expr}' ({e})") from None


# --- public API ----------------------------------------------------------------------------------------


def parse_hyperyaml(text: str, source: str = "<string>",
                    overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Parse HyperPyYAML text into plain data with `Tagged` nodes and all references resolved.

    `source` names the text in error messages (the file path). `overrides` is merged into the document
    before references are resolved, like HyperPyYAML's `overrides` (upstream passes
    `{"qwen_pretrain_path": <model_dir>/CosyVoice-BlankEN}`).
    """
    try:
        document = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = " ".join(str(e.problem or e.context or "").split())
        raise BundleError(f"{source}: not valid YAML: {where}{problem}") from None
    except yaml.YAMLError as e:
        raise BundleError(f"{source}: not valid YAML: {' '.join(str(e).split())}") from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise BundleError(f"{source}: expected a mapping of keys at the top level, "
                          f"got {type(document).__name__}")
    if overrides:
        _merge(document, overrides, (), source)
    resolver = _Resolver(document, source)
    return {key: resolver.value((key,)) for key in document}


def load_hyperyaml(path: Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read a HyperPyYAML file; see `parse_hyperyaml`. Errors are `BundleError`s naming `path`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None
    return parse_hyperyaml(text, str(path), overrides)
