"""Audio that comes in over the wire: upload sizes and base64 uploads (what goes out is
`cosyvoice_runtime.audio_files`'s)."""

from __future__ import annotations

import base64
import binascii

from .errors import FieldError
from .settings import MAX_UPLOAD_BYTES


def check_upload(data: bytes, field: str) -> bytes:
    """`data` if it is a plausible upload size, else a `FieldError` (400 empty, 413 too large)."""
    if not data:
        raise FieldError(field, f"{field} is empty; send an audio file")
    if len(data) > MAX_UPLOAD_BYTES:
        raise FieldError(field, f"{field} is {len(data)} bytes; the limit is {MAX_UPLOAD_BYTES}", status=413)
    return data


def decode_base64_audio(value: str, field: str, *, else_: str = "server paths are not read") -> bytes:
    """The bytes of an audio file sent as base64 (standard or URL-safe alphabet, `data:` URL allowed);
    `else_` says, where it is not, what else the field may hold."""
    text = value.strip()
    if text.startswith("data:"):
        text = text.partition(",")[2]
    text = "".join(text.split())
    try:
        data = base64.b64decode(text.replace("-", "+").replace("_", "/") + "=" * (-len(text) % 4),
                                validate=True)
    except (binascii.Error, ValueError):
        raise FieldError(field, f"{field} is not base64: send the audio file's bytes base64-encoded "
                                f"({else_})") from None
    return check_upload(data, field)
