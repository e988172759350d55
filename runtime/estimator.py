"""`flow_estimator`'s calls run on the `flow_estimator_cached` graph, so the runtime holds the DiT once.

A runtime bundle has the DiT twice: `flow_estimator` (offline, and the final streaming chunk) and
`flow_estimator_cached` (the other streaming chunks), 1.3 GB of weights each at full size. Two sessions
cannot share them here: onnxruntime pre-packs every MatMul weight into a per-session copy, shares those
copies only through a prepacked-weights container that its Python API does not offer, and turning
pre-packing off changes MLAS's summation order, hence the outputs. So the runtime opens one graph.

With nothing cached (zero past frames, offset 0, the conv caches' zero left padding) the cached graph
runs the same operators on the same values as `flow_estimator` with an all-ones mask, which is the only
mask the runtime feeds: its velocities are bit-identical on the reference backend (onnxruntime CPU;
tests/test_runtime_estimator.py on the demo bundle, several lengths, block-causal and full attention; the
full-size figures are in docs/performance.md, issue 6), and it takes the same time.

The cost: the cached graph's `present_*` are graph outputs, which onnxruntime keeps until the call ends
even when they are not fetched, where `flow_estimator` frees each block's keys and values after the
block. A call over T frames holds 16·depth·dim bytes more per frame (0.36 MB at full size): 1 GB at the
3000-frame maximum, less than the 1.3 GB of weights saved.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from cosyvoice_graphs import GraphSpec, empty_caches

from .errors import FeedError
from .runners import Runner, RunnerBase


class EstimatorOnCached(RunnerBase):
    """A `flow_estimator` runner whose calls run `flow_estimator_cached` with empty caches.

    It takes `flow_estimator`'s feeds and returns its outputs (the velocity); the cached graph's
    `present_*` outputs are not copied out. `mask` must be all ones (no padding), as every runtime call
    feeds it. Closing it leaves `cached`, which its owner closes, open.
    """

    def __init__(self, cached: Runner, spec: GraphSpec) -> None:
        """`cached`: an open `flow_estimator_cached` runner; `spec`: `flow_estimator`'s spec."""
        super().__init__(spec)
        if (spec.name, cached.spec.name) != ("flow_estimator", "flow_estimator_cached"):
            raise ValueError(f"EstimatorOnCached runs flow_estimator on flow_estimator_cached, "
                             f"not {spec.name} on {cached.spec.name}")
        self.cached = cached
        """The runner that does the work (shared with the streaming flow)."""
        self._caches = empty_caches(cached.spec)
        self._shared = [name for name in spec.input_names if name in cached.spec.input_names]

    def _run(self, feeds: Mapping[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        mask = feeds["mask"]
        if not np.all(mask == 1):
            raise FeedError(f"{self.spec.name}.mask: padding (a mask value other than 1) is not supported "
                            "when the estimator runs on flow_estimator_cached")
        cached_feeds = {**{name: feeds[name] for name in self._shared},
                        "offset": np.zeros(1, dtype=np.int64), **self._caches}
        # infer_outputs: the velocity only, and not through `infer`, so the call counts as flow_estimator's
        return self.cached.infer_outputs(cached_feeds, names)

    def _release(self) -> None:
        pass  # the cached runner belongs to whoever opened it
