"""`cosyvoice-serve` (also `python -m cosyvoice_serve`): the CLI, or one line naming the serve extra where
it (FastAPI, uvicorn, grpcio, ...) is missing, or the ray extra where `--ray` needs it."""

from __future__ import annotations

from cosyvoice_runtime.extras import run_console_script


def main() -> None:
    """The `cosyvoice-serve` console script."""
    # SIGTERM is the server's signal to stop: uvicorn, gRPC and Ray take it and shut down gracefully
    run_console_script("cosyvoice-serve", "cosyvoice_serve.cli", ("serve", "ray"), unwind_on_signals=False)


if __name__ == "__main__":
    main()
