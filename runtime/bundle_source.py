"""Which runtime bundle a command runs (`--model`, else `$COSYVOICE_MODEL_DIR`, else the demo bundle), and
which prompt (`--prompt-wav`, else the bundle's own).

`--model` may name a runtime bundle or a model bundle (upstream's model directory). A model bundle is
exported on first use into a cache folder (`$COSYVOICE_CACHE_DIR`, default `~/.cache/cosyvoice`) by the
`cosyvoice-export all` command of the `export` extra (torch; run as a command, never imported); later
runs reuse that export while the model's files keep their sizes and modification times and its format is
this runtime's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cosyvoice_graphs import ModelDims, Precision, spec
from cosyvoice_graphs.bundle_layout import GRAPHS_DIR, MANIFEST, MODEL_YAML, PROMPT_TEXT, PROMPT_WAV, QWEN_DIR
from cosyvoice_graphs.precision import FP32
from cosyvoice_graphs.precision_plan import PrecisionPlan

from .atomic_files import check_writable, write_json_atomic
from .bundle import BundleGraphs, RuntimeBundle, StreamConstants
from .demo import DEMO_BUNDLE
from .errors import RuntimeBundleError, UserError, home_folder, path_problem
from .extras import install_command, missing_modules

MODEL_DIR_ENV = "COSYVOICE_MODEL_DIR"
CACHE_DIR_ENV = "COSYVOICE_CACHE_DIR"
EXPORT_COST = "the real model: about 2 minutes on 2 cores, 8 GB of memory, 2.9 GB of disk"
"""What the first use of a model bundle costs (README's quick start, measured on the full-size bundle)."""
STAMP = "source-stamp.json"
"""Beside a cached export: the size and mtime of every file of the model bundle it was made from."""


@dataclass(frozen=True)
class BundleChoice:
    path: Path
    """The runtime bundle's folder."""
    origin: str
    """Where it came from, for the user: "--model", "$COSYVOICE_MODEL_DIR ...", "the demo bundle"."""
    default: bool
    """Chosen without --model (worth telling the user which)."""


DEMO_ORIGIN = "the embedded demo bundle"


def choose_bundle(model: Path | None, *, progress: bool = True, precision: str = FP32.name,
                  name: str = "--model", provider: str | None = None) -> BundleChoice:
    """`model` if given, else `$COSYVOICE_MODEL_DIR`, else the demo bundle; model bundles are exported
    (or their cached export reused) first, in `precision` (`cosyvoice-export all --precision`). `name` is
    what errors call `model` (the option or argument it came in); `provider`, where given, is what will run
    the bundle: an export is refused before it starts where nothing that runs graphs on it is installed."""
    path, origin = requested_bundle(model, name)
    if path == DEMO_BUNDLE and model is None:
        return BundleChoice(DEMO_BUNDLE, f"{DEMO_ORIGIN} (tiny, random weights: noise, not speech)",
                            default=True)
    return _runtime_bundle(path, origin, progress, precision, provider, default=model is None)


def requested_bundle(model: Path | None, name: str = "--model") -> tuple[Path, str]:
    """The folder `choose_bundle` opens (or exports) for `model`, and what named it, without looking at it:
    `model` (`name`), else `$COSYVOICE_MODEL_DIR` (a leading ~ expanded, as a shell would have), else the
    demo bundle."""
    if model is not None:
        return model, name
    env = os.environ.get(MODEL_DIR_ENV, "").strip()
    if env:
        return Path(env).expanduser(), f"${MODEL_DIR_ENV}"
    return DEMO_BUNDLE, DEMO_ORIGIN


@dataclass(frozen=True)
class BundleFront:
    """What a run's prompt and text are checked against before its bundle is exported or its graphs open:
    the bundle's tokenizer files and its own prompt. A model bundle's are the files its export copies."""

    root: Path
    """The folder given: a runtime bundle, or a model bundle not yet exported."""
    tokenizer_dir: Path
    prompt: tuple[Path, str] | None
    """The bundle's own prompt recording and transcript, or None (exports of upstream's release)."""
    dims: ModelDims | None
    """A runtime bundle's model constants; None for a model bundle, whose yaml gives them to its export."""

    @classmethod
    def of(cls, bundle: RuntimeBundle) -> BundleFront:
        return cls(bundle.root, bundle.tokenizer_dir, bundle.default_prompt(), bundle.dims)


def bundle_front(model: Path | None, name: str = "--model") -> BundleFront:
    """The front of the bundle `choose_bundle` would run for `model`, read without exporting a model bundle
    (minutes) or hashing a runtime bundle's files; a `RuntimeBundleError` for a folder that is neither."""
    path, runtime = _asked_bundle(model, name)
    if runtime:
        return BundleFront.of(RuntimeBundle.open(path))
    wav, text = path / PROMPT_WAV, path / PROMPT_TEXT
    prompt = (wav, text.read_text(encoding="utf-8").strip()) if wav.is_file() and text.is_file() else None
    return BundleFront(path, path / QWEN_DIR, prompt, None)


@dataclass(frozen=True)
class PlannedExport:
    """The graphs a model bundle's export (`choose_bundle`'s, without TensorRT plans) will have, known before
    it starts: what the options of a run are checked against there (`BundleGraphs`)."""

    root: Path
    """The model bundle."""
    precision: str
    graph_precisions: dict[str, Precision]
    stream_constants: StreamConstants
    trt_planned: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, model_dir: Path, precision: str) -> PlannedExport:
        plan = PrecisionPlan.parse(precision)
        # a graph's precision under a plan follows its spec's bounds, and the streaming constants are
        # upstream's yaml values: the same at every model size, so the embedded bundle's stand in (the
        # export's own are held against the options again once it is made)
        demo = RuntimeBundle.open(DEMO_BUNDLE)
        return cls(model_dir, plan.name, plan.precisions({g: spec(g, demo.dims) for g in plan.graph_names}),
                   demo.stream_constants)


def bundle_graphs(model: Path | None, name: str = "--model", precision: str = FP32.name) -> BundleGraphs:
    """The graphs `choose_bundle(model, precision=precision)` would run: a runtime bundle's (its manifest
    read, no file hashed), or those a model bundle's export will have, before it is made (minutes); a
    `RuntimeBundleError` for a folder that is neither."""
    path, runtime = _asked_bundle(model, name)
    return RuntimeBundle.open(path) if runtime else PlannedExport.of(path, precision)


def _asked_bundle(model: Path | None, name: str) -> tuple[Path, bool]:
    """The folder `choose_bundle` would run or export for `model`, and whether it is a runtime bundle (else
    a model bundle); a `RuntimeBundleError` for a folder that is neither."""
    path, origin = requested_bundle(model, name)
    return path, (path == DEMO_BUNDLE and model is None) or _is_runtime_bundle(path, origin)


@dataclass(frozen=True)
class PromptChoice:
    wav: Path
    text: str
    """The transcript ("" when none was given: cross-lingual and instruct2 need none)."""
    default: bool
    """The bundle's own prompt (worth telling the user)."""


def choose_prompt(front: BundleFront, wav: Path | None, text: str | None) -> PromptChoice:
    """The given prompt, else the bundle's own with its transcript (unless `text` is given)."""
    if wav is not None:
        return PromptChoice(wav, text or "", default=False)
    default = front.prompt
    if default is None:
        raise UserError(f"--prompt-wav is needed: {front.root} carries no prompt of its own")
    return PromptChoice(default[0], default[1] if text is None else text, default=True)


def cache_root() -> tuple[Path, str]:
    """Where exports of model bundles are kept, and what chose it (for messages)."""
    env = os.environ.get(CACHE_DIR_ENV, "").strip()
    if env:  # a leading ~ expanded, as a shell would have (a .env file's value is not)
        return Path(env).expanduser(), f"${CACHE_DIR_ENV}"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg:
        return Path(xdg).expanduser() / "cosyvoice", "$XDG_CACHE_HOME"
    home = home_folder("the export cache", f"set ${CACHE_DIR_ENV} to a folder for it")
    return home / ".cache" / "cosyvoice", f"~/.cache; ${CACHE_DIR_ENV} sets another"


def check_requested_bundle(model: Path | None, name: str = "--model") -> None:
    """What `choose_bundle` would refuse about the folder it is asked for (not there, a file, neither kind of
    bundle), without exporting or opening anything: for a command to refuse a wrong folder before its
    imports and its other checks. A `RuntimeBundleError`."""
    path, origin = requested_bundle(model, name)
    if path != DEMO_BUNDLE or model is not None:
        _is_runtime_bundle(path, origin)


def _is_runtime_bundle(path: Path, origin: str) -> bool:
    """Whether `path` (named by `origin`) is a runtime bundle (else a model bundle); a
    `RuntimeBundleError` where it is neither."""
    problem = path_problem(path)  # one not there is said below
    if problem is not None:
        raise RuntimeBundleError(f"{path} ({origin}): {problem}")
    if path.is_dir() and not os.access(path, os.R_OK | os.X_OK):  # else a PermissionError from what follows
        raise RuntimeBundleError(f"{path} ({origin}): cannot be read (permission denied)")
    if (path / MANIFEST).is_file():
        return True
    if not path.exists():
        # "owner/name" whose owner is no folder here: a model hub's id, as upstream's AutoModel downloads
        hub = (len(path.parts) == 2 and not path.is_absolute() and not Path(path.parts[0]).exists())
        if str(path).startswith("~"):
            hint = "; a leading ~ is not expanded within quotes: give the home folder's path"
        elif hub:
            hint = ("; a model hub id? `cosyvoice-export download` fetches the model into a folder to give "
                    "here")
        else:
            hint = ""
        raise RuntimeBundleError(f"{path} ({origin}): does not exist{hint}")
    if not path.is_dir():
        raise RuntimeBundleError(f"{path} ({origin}): is a file; a bundle is a folder")
    if (path / GRAPHS_DIR).is_dir():  # graphs written, the manifest (written last) not
        raise RuntimeBundleError(f"{path} ({origin}): an incomplete export (graphs but no {MANIFEST}): run "
                                 f"cosyvoice-export all --out {path} again")
    if not (path / MODEL_YAML).is_file():
        raise RuntimeBundleError(f"{path} ({origin}): neither a runtime bundle (no {MANIFEST}) nor a model "
                                 f"bundle (no {MODEL_YAML})")
    return False


def _runtime_bundle(path: Path, origin: str, progress: bool, precision: str, provider: str | None, *,
                    default: bool) -> BundleChoice:
    if _is_runtime_bundle(path, origin):
        return BundleChoice(path, f"{origin} ({path})", default)
    resolved = path.resolve()
    root, chosen_by = cache_root()
    folder = root / f"{resolved.name}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}"
    if precision != FP32.name:
        folder = folder.with_name(f"{folder.name}-{precision}")
    out, stamp = folder / "runtime", _stamp(resolved)
    if _read_json(folder / STAMP) == stamp and _opens(out):
        return BundleChoice(out, f"{origin} ({path}), exported earlier to {out}", default)
    if provider is not None:  # before the export's minutes; onnxruntime is imported only here
        from .runners import check_provider_installed

        check_provider_installed(provider)
    check_writable(folder, f"the export cache ({chosen_by})", directory=True)  # before its minutes
    _export(resolved, out, f"{path} ({origin})", progress, precision)
    write_json_atomic(folder / STAMP, stamp)
    return BundleChoice(out, f"{origin} ({path}), exported now to {out}", default)


def _export(model_dir: Path, out: Path, what: str, progress: bool, precision: str = FP32.name) -> None:
    """`cosyvoice-export all` as a command: the runtime never imports the exporter (or torch)."""
    command = console_script("cosyvoice-export")
    # this environment's command cannot run without the extra's modules, which are looked up here unimported
    if command is None or (Path(command).parent == Path(sys.executable).parent and missing_modules("export")):
        raise RuntimeBundleError(f"{what} is a model bundle; exporting it needs the export extra "
                                 f"({install_command('export')}), which provides cosyvoice-export")
    # --wait: a second process asking for the same model waits for the first one's export, then reuses it
    args = [command, "all", "--model-dir", str(model_dir), "--out", str(out), "--precision", precision,
            "--wait"]
    if progress:  # stdout is the command's own output: the export's report goes to stderr with its bar
        print(f"{what} is a model bundle: exporting it once into {out} ({EXPORT_COST}); later runs reuse it",
              file=sys.stderr, flush=True)
        status, error = _run_showing_stderr(args)
    else:
        done = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
        status, error = done.returncode, ((done.stderr or "").strip().splitlines() or [""])[-1]
    if status != 0:
        detail = error.removeprefix("error: ") or f"exit status {status}"
        raise RuntimeBundleError(f"exporting {what} failed: {detail}")


def _run_showing_stderr(args: list[str]) -> tuple[int, str]:
    """Run `args` with its stdout and stderr shown on this process's stderr as they come (its progress bar
    live), but for its `error: ` lines, which the caller's own one line carries: its exit status and its
    last such line ("" if none)."""
    error = b""
    with subprocess.Popen(args, stdout=_stderr_fd(), stderr=subprocess.PIPE) as child:
        assert child.stderr is not None
        pending = b""
        while chunk := os.read(child.stderr.fileno(), 1 << 16):  # what has come, not a full buffer
            pending += chunk
            # a bar redraws its line after each \r: each piece shows once its \r or \n has come
            while (end := min((i for i in (pending.find(b"\r"), pending.find(b"\n")) if i >= 0),
                              default=-1)) >= 0:
                piece, pending = pending[:end + 1], pending[end + 1:]
                if piece.startswith(b"error: "):
                    error = piece
                else:
                    _show(piece)
        if pending.startswith(b"error: "):
            error = pending
        else:
            _show(pending)
    return child.returncode, error.decode(errors="replace").strip()


def _show(data: bytes) -> None:
    sys.stderr.write(data.decode(errors="replace"))
    sys.stderr.flush()


def _stderr_fd() -> int | None:
    """This process's stderr as a file descriptor for a child's output; None (the child keeps stdout)
    where stderr is no file (a test's capture)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def console_script(name: str) -> str | None:
    """The console script `name` of this environment (beside its Python), else the one on PATH, else
    None."""
    script = Path(sys.executable).with_name(name)
    return str(script) if script.is_file() else shutil.which(name)


STAMPED = ("*.pt", "*.yaml", "*.onnx", "CosyVoice-BlankEN/**/*", "asset/**/*")
"""The files of a model folder an export reads (checkpoints, yaml, ONNX models, the Qwen tokenizer's folder,
the demo prompt): a change to one of them makes a new export, one to any other file (a git checkout's .git,
notes beside the model) does not."""


def _stamp(model_dir: Path) -> dict[str, list[int]]:
    """Size and mtime (ns) of every file of `model_dir` an export reads (`STAMPED`), by relative path."""
    stamp = {}
    files = {p for pattern in STAMPED for p in model_dir.glob(pattern) if p.is_file()}
    for file in sorted(files):
        stat = file.stat()
        stamp[file.relative_to(model_dir).as_posix()] = [stat.st_size, stat.st_mtime_ns]
    return stamp


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _opens(out: Path) -> bool:
    """Whether this runtime opens the cached export `out` (its format and its graphs' spec versions are
    ours): one an earlier exporter made otherwise is made again."""
    try:
        RuntimeBundle.open(out)
    except RuntimeBundleError:
        return False
    return True
