"""pixi.toml's tasks: upstream's task names are there, and each runs a command and subcommand that exist;
the dev environment lints and installs as CI does."""

from __future__ import annotations

import importlib
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PIXI = tomllib.loads((ROOT / "pixi.toml").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
REQUIRED = {"download-model", "export-onnx", "example", "webui", "serve", "test"}
"""The tasks upstream's users know by name."""
TEST_COMMAND = "bash ci/test.sh"
CI = (ROOT / "ci" / "test.sh").read_text(encoding="utf-8")
CI_VENV = ".venv/bin/"
"""Where ci/test.sh's main venv, the one with the dev extras, keeps its commands."""
LINTERS = {"ruff", "mypy"}


def _tasks() -> dict[str, list[str]]:
    """Every task's command, by feature and name (`[tasks]` is the default feature)."""
    tables = {"default": PIXI.get("tasks", {})}
    tables |= {name: feature.get("tasks", {}) for name, feature in PIXI.get("feature", {}).items()}
    return {f"{feature}.{name}": shlex.split(task if isinstance(task, str) else task["cmd"])
            for feature, table in tables.items() for name, task in table.items()}


TASKS = _tasks()
OURS = {task: argv for task, argv in TASKS.items() if argv[0].startswith("cosyvoice-")}


def _commands(name: str) -> list[list[str]]:
    return [argv for task, argv in TASKS.items() if task.split(".", 1)[1] == name]


def test_upstreams_tasks_are_there_and_run_our_commands() -> None:
    names = {task.split(".", 1)[1] for task in TASKS}
    assert REQUIRED <= names, f"missing tasks: {sorted(REQUIRED - names)}"
    for name in REQUIRED:
        for argv in _commands(name):
            assert argv[0] in SCRIPTS or shlex.join(argv) == TEST_COMMAND, (name, argv)
    assert (ROOT / TEST_COMMAND.split()[1]).is_file()


def test_the_real_model_tasks_chain() -> None:
    """download-model writes what export-onnx reads, and export-onnx what example, webui and serve read."""
    (download,) = {tuple(argv) for argv in _commands("download-model")}
    (export,) = {tuple(argv) for argv in _commands("export-onnx")}
    assert download[:2] == ("cosyvoice-export", "download")
    assert export[export.index("--model-dir") + 1] == download[2]
    for name in ("example", "webui", "serve"):
        for argv in _commands(name):
            assert argv[argv.index("--model") + 1] == export[export.index("--out") + 1], name


def test_every_task_is_in_one_environment() -> None:
    """A task that two environments hold makes `pixi run TASK` ask which (and fail where nobody answers);
    the default feature's tasks are every environment's and pixi runs them in the default one."""
    features = {name: set(feature.get("tasks", {})) for name, feature in PIXI.get("feature", {}).items()}
    holders: dict[str, list[str]] = {}
    for environment, chosen in PIXI["environments"].items():
        chosen = chosen["features"] if isinstance(chosen, dict) else chosen
        for task in set().union(*(features.get(f, set()) for f in chosen)):
            holders.setdefault(task, []).append(environment)
    assert {task: envs for task, envs in holders.items() if len(envs) > 1} == {}
    assert not set(holders) & set(PIXI.get("tasks", {}))


@pytest.mark.parametrize("task", sorted(OURS))
def test_task_command_parses(task: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                             ) -> None:
    """The task's command line with --help appended, run by the console script's entry point: click rejects
    an unknown subcommand or option before it prints the help."""
    argv = OURS[task]
    assert argv[0] in SCRIPTS, f"{task}: {argv[0]} is not a console script of pyproject.toml"
    module, function = SCRIPTS[argv[0]].split(":")
    entry_point = getattr(importlib.import_module(module), function)
    monkeypatch.setattr(sys, "argv", [*argv, "--help"])
    with pytest.raises(SystemExit) as exit:
        entry_point()
    out, err = capsys.readouterr()
    if exit.value.code == 2 and "pip install" in err:
        pytest.skip(err.strip())  # the script's extra is not installed here
    assert exit.value.code == 0, f"{task}: {err}"
    assert out.startswith(f"Usage: {argv[0]}")


def test_the_lint_task_runs_cis_lint() -> None:
    """`pixi run lint` runs ci/test.sh's ruff and mypy command lines, in its order."""
    ci = [argv for argv in (shlex.split(line) for line in CI.splitlines() if line.startswith(CI_VENV))
          if argv[0].removeprefix(CI_VENV) in LINTERS]
    ci = [[argv[0].removeprefix(CI_VENV), *argv[1:]] for argv in ci]
    assert {argv[0] for argv in ci} == LINTERS
    (lint,) = _commands("lint")
    commands: list[list[str]] = [[]]
    for token in lint:
        if token == "&&":
            commands.append([])
        else:
            commands[-1].append(token)
    assert commands == ci


def test_the_dev_environment_installs_cis_extras() -> None:
    """The dev feature's extras are those ci/test.sh installs its main venv with."""
    (spec,) = re.findall(rf"^{re.escape(CI_VENV)}pip install .*-e '\.\[([a-z0-9,-]+)\]'", CI, re.MULTILINE)
    extras = PIXI["feature"]["dev"]["pypi-dependencies"][PYPROJECT["project"]["name"]]["extras"]
    assert sorted(extras) == sorted(spec.split(",")) and len(set(extras)) == len(extras)
