"""Write this folder's copy of the front-end oracle from the full one (`../shared/reference/frontend-oracle`):
its text cases whole, and the resampling cases small enough to keep in the repository, so the tests that
prove the front end equal to upstream's libraries run wherever the repository is cloned.

The resampling subset: `clicks` at every rate pair (every kernel, the identity at equal rates), `lenclicks`
(the float32 length rule) and `stereo_cancel` (the channels averaged before resampling): 21 of the 72 cases,
about 0.4 MB compressed where the whole is 32 MB.

    python tests/data/frontend_oracle/subset.py ../shared/reference/frontend-oracle
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SIGNALS = ("clicks", "lenclicks", "stereo_cancel")
RESAMPLE = "resample_subset.npz"
TEXT = "text_normalize.json"


def subset(oracle: Path, out: Path) -> None:
    """Write `out`'s `RESAMPLE` (the `SIGNALS` cases of `oracle`'s resample.npz, its metadata with only
    them) and `TEXT` (a copy)."""
    with np.load(oracle / "resample.npz", allow_pickle=False) as npz:
        meta = json.loads(str(npz["__meta__"]))
        meta["cases"] = {name: case for name, case in meta["cases"].items() if name.split("__")[0] in SIGNALS}
        arrays = {key: npz[key] for key in npz.files if key.split("__")[0] in SIGNALS}
    np.savez_compressed(out / RESAMPLE, __meta__=np.array(json.dumps(meta, sort_keys=True)), **arrays)
    shutil.copyfile(oracle / TEXT, out / TEXT)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "resample.npz").is_file():
        sys.exit("usage: subset.py ORACLE_DIR (the folder holding resample.npz and text_normalize.json)")
    subset(Path(sys.argv[1]), HERE)
