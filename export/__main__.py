"""`cosyvoice-export` (also `python -m cosyvoice_export`): the CLI, or one line naming the export extra
where it (torch, ...) is missing."""

from __future__ import annotations

from cosyvoice_runtime.extras import run_console_script
from cosyvoice_runtime.process_memory import rerun_with_huge_pages


def main() -> None:
    """The `cosyvoice-export` console script, on transparent huge pages where glibc would not use them
    unasked: an export copies each graph's weights many times over."""
    rerun_with_huge_pages("cosyvoice-export", "cosyvoice_export")
    run_console_script("cosyvoice-export", "cosyvoice_export.cli", ("export",))


if __name__ == "__main__":
    main()
