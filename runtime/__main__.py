"""`cosyvoice-run` (also `python -m cosyvoice_runtime`): the CLI, or one line saying what to install where
onnxruntime is missing."""

from __future__ import annotations

from cosyvoice_runtime.extras import run_console_script


def main() -> None:
    """The `cosyvoice-run` console script."""
    run_console_script("cosyvoice-run", "cosyvoice_runtime.cli")


if __name__ == "__main__":
    main()
