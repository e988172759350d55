"""What a new user meets when installing: every console script run without the extra it needs says which
to install in one line (exit 2), `cosyvoice-run --model` on a model bundle included; no install the README,
pixi or CI uses holds both onnxruntime builds, and onnxruntime's version bound is the one CI tests; pixi
solves no environment for a platform its wheels lack; the sdist is the package's source and what the README
points at, without the test suite."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from cosyvoice_runtime import extras
from cosyvoice_runtime.bundle_source import CACHE_DIR_ENV, MODEL_DIR_ENV

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PIXI = tomllib.loads((ROOT / "pixi.toml").read_text(encoding="utf-8"))
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
OPTIONAL: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
PACKAGE = canonicalize_name(PYPROJECT["project"]["name"])
BUILDS = {canonicalize_name(extras.CPU_ONNXRUNTIME), canonicalize_name(extras.GPU_ONNXRUNTIME)}
MISSING_ORT = (r"error: {script} needs onnxruntime, which is not installed: pip install "
               r"'cosyvoice-onnx\[cpu\]' \(on a CUDA machine 'cosyvoice-onnx\[gpu\]'\)")
MISSING_TORCH = (r"error: {script} needs the export extra \(torch is not installed\): pip install "
                 r"'cosyvoice-onnx\[export\]'")


def run_script(script: str, *args: str, unimportable: tuple[str, ...], env: dict[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The console script `script` as pyproject declares it, in a fresh interpreter where the modules
    `unimportable` cannot be imported (as where their distributions are not installed)."""
    module, function = SCRIPTS[script].split(":")
    code = (f"import sys; sys.argv[0] = {script!r}; sys.modules.update(dict.fromkeys({unimportable!r})); "
            f"from {module} import {function}; {function}()")
    environment = {k: v for k, v in os.environ.items() if k != MODEL_DIR_ENV} | (env or {})
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=environment, cwd=cwd, timeout=120)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a command that exited with status 2 and printed nothing else."""
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


# --- missing extras: one line, exit 2 ---------------------------------------------------------------------


@pytest.mark.parametrize(("script", "args", "blocked", "extra"), [
    ("cosyvoice-serve", ("--model", "x"), "fastapi", "serve"),
    ("cosyvoice-serve", ("--model", "x"), "grpc", "serve"),
    ("cosyvoice-export", ("tiny-bundle", "out"), "torch", "export"),
    # before the input is judged (those commands judge it before they import torch)
    ("cosyvoice-export", ("all", "--model-dir", "none", "--out", "out"), "torch", "export"),
    ("cosyvoice-export", ("check-bundle", "none"), "torch", "export"),
    ("cosyvoice-export", ("synth", "--model-dir", "none", "--text", "Hi.", "--out", "o.wav"), "torch",
     "export"),
    ("cosyvoice-export", ("demo",), "onnxslim", "export"),
    ("cosyvoice-export", ("download", "none"), "torch", "export"),
])
def test_a_missing_extra_is_one_line_naming_it_and_the_pip_command(script: str, args: tuple[str, ...],
                                                                   blocked: str, extra: str,
                                                                   tmp_path: Path) -> None:
    line = one_line(run_script(script, *args, unimportable=(blocked,), cwd=tmp_path))
    found = re.fullmatch(rf"error: {script} needs the {extra} extra \((\S+) is not installed\): pip install "
                         rf"'cosyvoice-onnx\[{extra}\]'", line)
    assert found, line
    # the blocked module, or where the extra is not installed at all another of its modules imported first
    assert found[1] == blocked or found[1] in extras.EXTRA_MODULES[extra]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_script_without_onnxruntime_says_to_install_one_build(script: str) -> None:
    own = extras.SCRIPT_EXTRA.get(script)
    line = one_line(run_script(script, "--help", unimportable=("onnxruntime",)))
    if own is not None and extras.missing_modules(own):  # as in the base install: named together
        assert line.startswith(f"error: {script} needs onnxruntime and the {own} extra, which are not "
                               "installed: pip install "), line
    else:
        assert re.fullmatch(MISSING_ORT.format(script=script), line)


@pytest.mark.parametrize(("script", "blocked", "cpu", "gpu"), [
    ("cosyvoice-export", "torch", "export", "export-gpu"),
    ("cosyvoice-serve", "uvicorn", "cpu,serve", "gpu,serve"),
])
def test_every_missing_part_is_named_in_the_one_line(script: str, blocked: str, cpu: str, gpu: str,
                                                     tmp_path: Path) -> None:
    """Without onnxruntime and without the script's own extra: both in one line, with one command."""
    args = ("tiny-bundle", "out") if script == "cosyvoice-export" else ("--help",)
    line = one_line(run_script(script, *args, unimportable=("onnxruntime", blocked), cwd=tmp_path))
    extra = cpu.split(",")[-1]
    assert line == (f"error: {script} needs onnxruntime and the {extra} extra, which are not installed: pip "
                    f"install 'cosyvoice-onnx[{cpu}]' (on a CUDA machine 'cosyvoice-onnx[{gpu}]')")


def test_the_python_api_names_the_missing_onnxruntime() -> None:
    code = ("import sys; sys.modules['onnxruntime'] = None\n"
            "try:\n    from cosyvoice_runtime import AutoModel\n"
            "except ModuleNotFoundError as e:\n    print(e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == ("cosyvoice_runtime needs onnxruntime, which is not installed: pip install "
                                   "'cosyvoice-onnx[cpu]' (on a CUDA machine 'cosyvoice-onnx[gpu]')")


def test_the_servers_help_needs_no_serve_extra() -> None:
    done = run_script("cosyvoice-serve", "--help",
                      unimportable=("fastapi", "starlette", "uvicorn", "grpc", "av"))
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout and "--provider" in done.stdout


@pytest.mark.parametrize("script", ["cosyvoice-run", "cosyvoice-golden", "cosyvoice-bench",
                                    "cosyvoice-export"])
def test_the_scripts_help_without_torch(script: str) -> None:
    done = run_script(script, "--help", unimportable=("torch",))
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout


def test_bench_vs_torch_without_torch_is_one_line(tmp_path: Path) -> None:
    from cosyvoice_runtime.demo import DEMO_BUNDLE

    done = run_script("cosyvoice-bench", "--model", str(DEMO_BUNDLE), "--vs-torch", "--model-dir",
                      str(tmp_path), "--quick", unimportable=("torch",))
    assert re.fullmatch(MISSING_TORCH.format(script="cosyvoice-bench"), one_line(done))


def test_run_on_a_model_bundle_without_the_export_extra_says_so_and_exports_nothing(tmp_path: Path) -> None:
    from cosyvoice_runtime.bundle import RuntimeBundle
    from cosyvoice_runtime.demo import DEMO_BUNDLE

    model = tmp_path / "Fun-CosyVoice3-0.5B"
    # what a run reads of a model bundle before exporting it: its tokenizer (the demo bundle's copy of one);
    # the yaml makes the folder a model bundle to `--model`
    shutil.copytree(RuntimeBundle.open(DEMO_BUNDLE).tokenizer_dir, model / "CosyVoice-BlankEN")
    (model / "cosyvoice3.yaml").write_text("")
    cache = tmp_path / "cache"
    done = run_script("cosyvoice-run", "--model", str(model), "--text", "Hi.", "--prompt-wav",
                      str(DEMO_BUNDLE / "asset" / "zero_shot_prompt.wav"), "--prompt-text", "Hello.", "--out",
                      str(tmp_path / "out.wav"), unimportable=("torch",), env={CACHE_DIR_ENV: str(cache)})
    assert one_line(done) == (f"error: {model} (--model) is a model bundle; exporting it needs the export "
                              "extra (pip install 'cosyvoice-onnx[export]'), which provides cosyvoice-export")
    assert not cache.exists() and not (tmp_path / "out.wav").exists()


def test_the_hints_never_add_a_second_onnxruntime(monkeypatch: pytest.MonkeyPatch) -> None:
    installed: set[str] = set()
    monkeypatch.setattr(extras, "installed", lambda name: name in installed)
    assert extras.install_command("export") == "pip install 'cosyvoice-onnx[export]'"
    assert extras.install_command("serve") == "pip install 'cosyvoice-onnx[serve]'"
    assert extras.gpu_install_command() in ("pip install 'cosyvoice-onnx[gpu]'",
                                            "pip install 'cosyvoice-onnx[export-gpu]'")
    installed.add(extras.GPU_ONNXRUNTIME)
    assert extras.install_command("export") == "pip install 'cosyvoice-onnx[export-gpu]'"
    installed.add(extras.CPU_ONNXRUNTIME)
    assert extras.gpu_install_command().startswith("pip uninstall -y onnxruntime onnxruntime-gpu && pip ")
    assert extras.gpu_install_command(tensorrt=True).endswith(",trt]'")


def test_the_gpu_extras_bring_cudas_libraries_and_the_tensorrt_onnxruntime_links() -> None:
    """`gpu` installs onnxruntime-gpu with NVIDIA's CUDA and cuDNN pip packages (without them its CUDA
    provider does not load), and onnx, which builds the graph stacking streams' DiT caches there; TensorRT is
    an extra of its own, on top of `gpu`, held to the major release onnxruntime-gpu 1.31's TensorRT provider
    links (libnvinfer.so.10), for CUDA 13 as that build is."""
    gpu, onnx = (Requirement(r) for r in OPTIONAL["gpu"])
    assert canonicalize_name(gpu.name) == canonicalize_name(extras.GPU_ONNXRUNTIME)
    assert gpu.extras == {"cuda", "cudnn"} and onnx.name == "onnx"
    trt = {canonicalize_name(r.name): r for r in map(Requirement, OPTIONAL["trt"])}
    assert trt[PACKAGE].extras == {"gpu"}
    assert set(trt) == {PACKAGE, "tensorrt-cu13", "polygraphy"}
    tensorrt = trt["tensorrt-cu13"].specifier
    assert "10.16.1.11" in tensorrt and "11.4.0.106" not in tensorrt
    assert OPTIONAL["export-gpu"] == ["cosyvoice-onnx[gpu,torch]"]


def test_golden_update_without_torch_names_the_extras_command() -> None:
    done = run_script("cosyvoice-golden", "update", unimportable=("torch",))
    assert one_line(done) == (f"error: update needs the export extra ({extras.install_command('export')}): "
                              "torch is not installed")


@pytest.mark.torch
def test_the_exporters_trt_hint_replaces_a_cpu_onnxruntime(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--trt` on a CUDA machine without TensorRT names the install that leaves one onnxruntime."""
    from cosyvoice_export.onnx import trt

    monkeypatch.setattr(trt, "cuda_device_name", lambda: "A GPU")
    monkeypatch.setitem(sys.modules, "polygraphy", None)
    monkeypatch.setattr(extras, "installed", lambda name: name == extras.CPU_ONNXRUNTIME)
    with pytest.raises(trt.TrtUnavailable) as raised:
        trt.require_trt()
    assert str(raised.value) == ("--trt needs TensorRT and polygraphy (pip uninstall -y onnxruntime "
                                 "onnxruntime-gpu && pip install 'cosyvoice-onnx[export-gpu,trt]'); "
                                 "polygraphy is not installed")


def test_only_the_extras_modules_are_taken_for_a_missing_extra() -> None:
    line = extras.missing_extra_line
    assert line("s", ModuleNotFoundError(name="google"), ("serve",)) is not None  # protobuf's namespace
    assert line("s", ModuleNotFoundError(name="torch.nn"), ("export",)) is not None
    assert line("s", ModuleNotFoundError(name="sympy"), ("export",)) is None  # a broken install, not an extra
    assert line("s", ModuleNotFoundError(name="torch"), ("serve",)) is None
    assert line("s", ModuleNotFoundError(name="onnx"), ()) is None  # not onnxruntime


@pytest.mark.parametrize(("extra", "modules"), [("torch", "export"), ("serve", "serve")])
def test_the_extras_modules_cover_every_distribution_of_the_extra(extra: str, modules: str) -> None:
    """Each distribution pyproject's `extra` lists provides a module `EXTRA_MODULES[modules]` names, so that
    its absence is recognised (checked where the distribution is installed)."""
    provided: dict[str, set[str]] = {}
    for module, distributions in metadata.packages_distributions().items():
        for distribution in distributions:
            provided.setdefault(canonicalize_name(distribution), set()).add(module)
    listed = {m.split(".")[0] for m in extras.EXTRA_MODULES[modules]}
    checked = [canonicalize_name(Requirement(r).name) for r in OPTIONAL[extra]]
    present = [d for d in checked if d in provided]
    if not present:
        pytest.skip(f"the {extra} extra is not installed")
    assert [d for d in present if not provided[d] & listed] == []


# --- one onnxruntime per install --------------------------------------------------------------------------


def distributions(chosen: set[str]) -> set[str]:
    """The distributions `pip install 'cosyvoice-onnx[chosen]'` brings directly, the extras' references to
    the package itself followed."""
    unknown = chosen - set(OPTIONAL)
    assert not unknown, f"extras {unknown} are not in pyproject.toml"
    found = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]}
    for extra in chosen:
        for requirement in map(Requirement, OPTIONAL[extra]):
            if canonicalize_name(requirement.name) == PACKAGE:
                found |= distributions(set(requirement.extras))
            else:
                found.add(canonicalize_name(requirement.name))
    return found


def readme_installs() -> dict[str, set[str]]:
    """Every set of extras the README and the docs pages install the package with (`'.[a,b]'`,
    `'cosyvoice-onnx[a]'`)."""
    installs = {}
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        found = re.findall(r"'(?:\.|cosyvoice-onnx)\[([a-z0-9,-]+)\]'", page.read_text(encoding="utf-8"))
        where = "README" if page.name == "README.md" else page.name
        installs |= {f"{where} [{spec}]": set(spec.split(",")) for spec in found}
    assert "README [export]" in installs, "the README's first command installs the package no more"
    return installs


SCRIPT_EXTRAS = {"cosyvoice-export": "export", "cosyvoice-serve": "serve", "cosyvoice-run": "cpu",
                 "cosyvoice-golden": "cpu", "cosyvoice-bench": "cpu"}
"""The extra each console script needs besides onnxruntime's build (`cpu`: that alone)."""


def test_the_readmes_real_model_commands_run_in_the_venv_the_first_command_made() -> None:
    """The four commands after the first: every console script they call has its extra's distributions in
    the venv by then (the first command's install, and any install line of the block before the
    command)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = re.search(r"\.venv/bin/pip install -e '\.\[([a-z0-9,-]+)\]'", text)
    assert first is not None
    block = text.split("Real model, in four commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    installed = set(first[1].split(","))
    scripts = 0
    for line in block.strip().splitlines():
        found = re.search(r"\.venv/bin/pip install -e '\.\[([a-z0-9,-]+)\]'", line)
        if found:
            installed |= set(found[1].split(","))
            continue
        script = re.match(r"\.venv/bin/(cosyvoice-[a-z]+) ", line)
        assert script is not None, line
        scripts += 1
        missing = distributions({SCRIPT_EXTRAS[script[1]]}) - distributions(installed)
        assert not missing, (script[1], installed, missing)
    assert scripts == 4


def features_of(environment: str) -> list[str]:
    """The features pixi.toml composes `environment` of (a list, or a table with `features`)."""
    chosen = PIXI["environments"][environment]
    return chosen["features"] if isinstance(chosen, dict) else chosen


def pixi_installs() -> dict[str, set[str]]:
    """Each pixi environment's extras: those of every feature it holds and of the default feature (the
    union, the most any merging rule could install)."""

    def extras_of(table: dict[str, Any]) -> set[str]:
        return set(table.get("pypi-dependencies", {}).get(PYPROJECT["project"]["name"], {}).get("extras", []))

    installs = {}
    for name in PIXI["environments"]:
        chosen = extras_of(PIXI)
        for feature in features_of(name):
            chosen |= extras_of(PIXI["feature"][feature])
        installs[f"pixi {name}"] = chosen
    return installs


def ci_installs() -> dict[str, set[str]]:
    """The extras ci/test.sh installs the package with (`-e '.[a,b]'`, or `-e .`: none)."""
    text = (ROOT / "ci" / "test.sh").read_text(encoding="utf-8")
    found = re.findall(r"-e (\S+)", text)
    assert found
    return {f"ci {spec}": set(re.findall(r"\[(.*)\]", spec)[0].split(",")) if "[" in spec else set()
            for spec in found}


INSTALLS = readme_installs() | pixi_installs() | ci_installs()


@pytest.mark.parametrize("where", sorted(INSTALLS))
def test_every_documented_install_holds_exactly_one_onnxruntime(where: str) -> None:
    assert len(distributions(INSTALLS[where]) & BUILDS) == 1, (where, distributions(INSTALLS[where]) & BUILDS)


WHEEL_PLATFORMS = {"onnxruntime-gpu": {"linux-64"}, "openvino": {"linux-64", "osx-arm64"}}
"""The pixi platforms where a distribution of the extras has a wheel for Python 3.11 at the releases
pyproject allows, at the glibc 2.28 pixi assumes for Linux (`pip download --no-deps --only-binary=:all:
--python-version 3.11 --platform TAG`); the others' wheels cover every platform of the workspace."""


@pytest.mark.parametrize("environment", sorted(PIXI["environments"]))
def test_no_pixi_environment_is_solved_for_a_platform_its_wheels_lack(environment: str) -> None:
    """An environment is solved for the workspace's platforms that all its features allow; one of them
    without a wheel of a distribution it installs fails the whole lock."""
    workspace = set(PIXI["workspace"]["platforms"])
    platforms = set(workspace)
    for feature in features_of(environment):
        allowed = set(PIXI["feature"][feature].get("platforms", workspace))
        assert allowed <= workspace, (feature, allowed - workspace)
        platforms &= allowed
    assert platforms, environment
    for name in sorted(distributions(pixi_installs()[f"pixi {environment}"]) & set(WHEEL_PLATFORMS)):
        assert platforms <= WHEEL_PLATFORMS[name], (name, platforms - WHEEL_PLATFORMS[name])


def test_the_builds_come_from_the_extras_alone() -> None:
    assert not distributions(set()) & BUILDS  # the base install: a GPU install adds to it
    assert distributions({"cpu"}) & BUILDS == {"onnxruntime"}
    assert distributions({"gpu"}) & BUILDS == {"onnxruntime-gpu"}
    assert distributions({"export"}) & BUILDS == {"onnxruntime"}
    assert distributions({"export-gpu"}) & BUILDS == {"onnxruntime-gpu"}
    assert distributions({"export", "gpu"}) & BUILDS == BUILDS  # what the check above catches
    assert {"README [export]", "pixi default", "ci '.[cpu]'"} <= set(INSTALLS)


def test_onnxruntime_is_bounded_below_by_the_release_ci_tests() -> None:
    pins = {}
    for line in (ROOT / "ci" / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            pins[canonicalize_name(requirement.name)] = str(requirement.specifier)
    pinned = pins["onnxruntime"].removeprefix("==")
    for build in BUILDS:
        bounds = [str(Requirement(r).specifier) for extra in OPTIONAL.values() for r in extra
                  if canonicalize_name(Requirement(r).name) == build]
        assert bounds == [f">={pinned}"], (build, bounds)


# --- the sdist --------------------------------------------------------------------------------------------


LEFT_OUT = {".git", "bundles", "pretrained_models", "build", "dist", "out"}
"""The repository root's folders that no checkout holds and a build must not read (venvs too)."""
BUILD_BACKEND = next(Requirement(r) for r in PYPROJECT["build-system"]["requires"]
                     if canonicalize_name(Requirement(r).name) == "setuptools")


def not_in_a_checkout(folder: str, names: list[str]) -> set[str]:
    """What a fresh checkout lacks. An egg-info above all: setuptools adds every file its SOURCES.txt lists
    to the sdist, so a stale one from an editable install would decide what ships."""
    left = {n for n in names if n.endswith(".egg-info") or n == "__pycache__" or n.endswith(".pyc")
            or (n.startswith(".") and n.endswith("_cache"))}
    if Path(folder) == ROOT:
        left |= {n for n in names if n in LEFT_OUT or n.startswith(".venv")}
    return left


class Sdist(NamedTuple):
    files: set[str]
    """Relative to the archive's top folder."""
    pkg_info: str
    stderr: str
    """The build's."""


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Sdist:
    """The sdist setuptools builds from a copy of the working tree, by the backend itself: offline, and
    without the `build` package."""
    try:
        version = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        pytest.skip("setuptools is not installed here")
    if version not in BUILD_BACKEND.specifier:
        pytest.skip(f"setuptools {version} is installed here; pyproject's build needs {BUILD_BACKEND}")
    work = tmp_path_factory.mktemp("sdist")
    source, out = work / "source", work / "dist"
    shutil.copytree(ROOT, source, ignore=not_in_a_checkout)
    build = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(out)], cwd=source, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    archive = out / done.stdout.strip().splitlines()[-1]
    with tarfile.open(archive) as tar:
        top = archive.name.removesuffix(".tar.gz")
        files = {m.name.removeprefix(f"{top}/") for m in tar.getmembers() if m.isfile()}
        pkg_info = tar.extractfile(f"{top}/PKG-INFO")
        assert pkg_info is not None
        return Sdist(files, pkg_info.read().decode(), done.stderr)


def test_the_sdist_holds_no_test_suite_but_what_the_docs_point_at(sdist: Sdist) -> None:
    """The suite reads files only the repository holds, so it stays there; the README's and the docs'
    links resolve, and the constraints file docs/install.md installs with is there."""
    files = sdist.files
    assert not [f for f in files if f.startswith("tests/")]
    assert "ci/constraints.txt" in files and "MANIFEST.in" in files
    pages = ["README.md", *(f for f in files if f.startswith("docs/") and f.endswith(".md"))]
    for page in pages:
        text = (ROOT / page).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" not in target:
                linked = os.path.normpath(Path(page).parent / target)
                assert linked in files, (page, target)


def test_the_sdist_holds_the_packages_data(sdist: Sdist) -> None:
    """Every file a package-data pattern of pyproject matches in the repository is in the sdist: what the
    runtime loads (the demo bundle, the web page), golden's cases, the proto, the `py.typed` markers."""
    files = sdist.files
    setuptools = PYPROJECT["tool"]["setuptools"]
    folders: dict[str, str] = setuptools["package-dir"]
    data: dict[str, list[str]] = setuptools["package-data"]
    for package in setuptools["packages"]:
        top, *rest = package.split(".")
        folder = "/".join([folders[top], *rest])
        for pattern in [*data.get("*", []), *data.get(package, [])]:
            matched = {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).glob(pattern) if p.is_file()}
            assert matched <= files, (package, pattern, sorted(matched - files)[:5])
    assert {"runtime/demo_bundle/manifest.json", "serve/page.html"} <= files


def test_the_sdist_declares_its_license_as_an_spdx_expression(sdist: Sdist) -> None:
    """PEP 639's `License-Expression`, from pyproject's `license` string, and the license's text; setuptools
    ends its support of the older table form, and of any other deprecated configuration, at a dated
    release."""
    head = sdist.pkg_info.partition("\n\n")[0]  # the headers, not the README after them
    headers = [line for line in head.splitlines() if line.startswith("License")]
    assert headers == [f"License-Expression: {PYPROJECT['project']['license']}", "License-File: LICENSE"]
    assert "LICENSE" in sdist.files and "Apache License" in (ROOT / "LICENSE").read_text()
    assert "SetuptoolsDeprecationWarning" not in sdist.stderr, sdist.stderr
