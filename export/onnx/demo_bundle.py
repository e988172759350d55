"""The demo runtime bundle that ships in the runtime package (`cosyvoice_runtime.demo`).

It is `all` over the tiny random model bundle (seed `DEMO_SEED`), without the export's own records
(OUT/.export), which only serve to skip unchanged graphs on a later export.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from cosyvoice_graphs.precision import FP32
from cosyvoice_runtime.demo import DEMO_BUNDLE, DEMO_SEED

from ..bundle.errors import BundleError
from ..bundle.tiny import write_bundle
from .bundle_assembly import export_all
from .output_dir import STATE_DIR, OutputDirError, check_out


def write_demo_bundle(out: Path | None = None, *, progress: bool = False) -> Path:
    """Export the tiny seed-`DEMO_SEED` model bundle to `out` (default `DEMO_BUNDLE`), replacing it only
    once the export has passed validation; returns `out`."""
    out = DEMO_BUNDLE if out is None else Path(out)
    here = Path.cwd().resolve()
    if out.resolve() in (here, *here.parents):
        raise OutputDirError(f"{out}: the working folder or a folder above it; choose another --out")
    check_out(out, FP32.name)  # a folder of other files is never replaced
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".demo-bundle-", dir=out.parent) as work:
        model = write_bundle(Path(work) / "model", size="tiny", seed=DEMO_SEED, progress=progress)
        report = export_all(model, Path(work) / "runtime", progress=progress)
        if not report.passed or report.manifest is None:
            raise BundleError(f"the demo bundle's export failed validation:\n{report.table()}")
        shutil.rmtree(report.out / STATE_DIR)
        old = Path(work) / "old"
        if out.exists():
            out.rename(old)
        report.out.rename(out)
    return out
