#!/usr/bin/env bash
# The test command (README's second command; .ci/run calls it): a venv with the export and dev
# extras, then lint and the test suite. Tests use tiny bundles; full-size work belongs in benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -c ci/constraints.txt -e '.[export,serve,dev]'
.venv/bin/ruff check export runtime graphs golden bench serve tests
.venv/bin/mypy runtime graphs golden bench serve
.venv/bin/pytest "$@"
