"""`cosyvoice-export` (also `python -m cosyvoice_export`): the CLI, or one line naming the export extra
where it (torch, ...) is missing."""

from __future__ import annotations

from cosyvoice_runtime.extras import run_console_script


def main() -> None:
    """The `cosyvoice-export` console script."""
    run_console_script("cosyvoice-export", "cosyvoice_export.cli", ("export",))


if __name__ == "__main__":
    main()
