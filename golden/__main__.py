"""`cosyvoice-golden` (also `python -m cosyvoice_golden`): the CLI, or one line saying what to install
where onnxruntime, or for `update` the export extra, is missing."""

from __future__ import annotations

from cosyvoice_runtime.extras import run_console_script


def main() -> None:
    """The `cosyvoice-golden` console script."""
    run_console_script("cosyvoice-golden", "cosyvoice_golden.cli", ("export",))


if __name__ == "__main__":
    main()
