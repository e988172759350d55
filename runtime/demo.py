"""The demo runtime bundle shipped inside the package: what `cosyvoice-run` uses when given no model.

It is the runtime bundle of the tiny random model bundle (`cosyvoice-export tiny-bundle DIR`, seed 0),
with that bundle's synthetic prompt; `cosyvoice-export demo-bundle` rewrites it, and a test checks that it
still equals a fresh export. Its weights are random: it makes noise, not speech.
"""

from __future__ import annotations

from pathlib import Path

DEMO_BUNDLE = Path(__file__).with_name("demo_bundle")
DEMO_SEED = 0
"""Seed of the tiny model bundle the demo bundle is exported from."""
