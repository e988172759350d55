"""Reading and checking upstream's `llm.pt` / `flow.pt` / `hift.pt` state dicts."""

from __future__ import annotations

import pickle
import warnings
import zipfile
from pathlib import Path

import torch

from ..manifest import Entry
from .errors import BundleError

ACCEPTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Stored dtypes we load; every tensor is computed in float32, as upstream's modules are."""


def read_pickled_dict(path: Path) -> dict:
    """`torch.load` a dict from `path` without executing pickled code; one-line `BundleError` otherwise."""
    if not path.exists():
        raise BundleError(f"{path}: file not found")
    if not path.is_file():
        raise BundleError(f"{path}: not a file")
    with path.open("rb") as f:
        head = f.read(9)
    if not head:
        raise BundleError(f"{path}: the file is empty; expected a PyTorch checkpoint")
    if head[8:9] == b"{":  # 8 bytes of header length, then the header's JSON
        raise BundleError(f"{path}: a safetensors file; expected a PyTorch checkpoint (torch.save)")
    try:
        with warnings.catch_warnings():  # torch's about a pickle protocol it may not read: the error says
            warnings.simplefilter("ignore", UserWarning)
            # mapped where it can be: torch.save's zip format; the legacy one (upstream's torch.load reads it
            # too) is read whole
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:  # the unpickler fails on damaged bytes in many ways, each meaning "unreadable"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not isinstance(e, RuntimeError | OSError | ValueError | EOFError | pickle.UnpicklingError):
            reason = f"its bytes do not unpickle: {type(e).__name__}"  # a KeyError's text is a number
        elif reason.startswith("Weights only load failed"):  # torch's advice to load it unsafely, left out
            reason = "it holds more than tensors and plain containers, which torch's safe loader refuses"
        raise BundleError(f"{path}: not a readable PyTorch checkpoint ({reason})") from None
    if not isinstance(obj, dict):
        raise BundleError(f"{path}: expected a dict, found {type(obj).__name__}")
    return obj


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Load a plain state dict from `path`.

    Non-tensor entries (training checkpoints' `epoch`/`step`) are dropped; anything that is not a
    mapping of names to tensors is a `BundleError`.
    """
    obj = read_pickled_dict(path)
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise BundleError(f"{path}: holds no tensors; expected a state dict")
    return tensors


def check_state_dict(path: Path, state: dict[str, torch.Tensor], expected: list[Entry]) -> None:
    """Raise a one-line `BundleError` on the first missing/unexpected key, shape or dtype mismatch, or tensor
    holding NaN or inf."""
    want = {e.key: e for e in expected}
    missing = [e.key for e in expected if e.key not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise BundleError(f"{path}: missing key {missing[0]}{more}")
    unexpected = [k for k in state if k not in want]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise BundleError(f"{path}: unexpected key {unexpected[0]}{more}")
    for key, t in state.items():
        e = want[key]
        if tuple(t.shape) != e.shape:
            raise BundleError(f"{path}: {key} has shape {list(t.shape)}, expected {list(e.shape)}")
        if t.dtype not in ACCEPTED_DTYPES:
            raise BundleError(f"{path}: {key} has dtype {str(t.dtype).removeprefix('torch.')}, "
                              "expected float32, float16 or bfloat16")
        finite = torch.isfinite(t)
        if not finite.all():
            raise BundleError(f"{path}: {key} holds {int((~finite).sum()):,} NaN or infinite values of "
                              f"{t.numel():,}; a trained network's weights are finite")


def to_float32(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cast every stored tensor to float32 (the dtype upstream's modules compute in)."""
    return {k: v.to(torch.float32) for k, v in state.items()}
