"""`cosyvoice-bench` (also `python -m cosyvoice_bench`): the CLI, or one line saying what to install where
onnxruntime, or for `--vs-torch` the export extra, is missing."""

from __future__ import annotations

from cosyvoice_runtime.extras import run_console_script


def main() -> None:
    """The `cosyvoice-bench` console script."""
    run_console_script("cosyvoice-bench", "cosyvoice_bench.cli", ("export",))


if __name__ == "__main__":
    main()
