"""Audio on the wire: PCM16 bytes, WAV files, a streaming WAV header, base64 uploads.

Float samples become 16-bit integers by libsndfile's conversion, the one `cosyvoice-run` writes its
WAV files with, so a stream's PCM equals the samples of the CLI's WAV for the same request. (Upstream's
server truncates `x * 2**15` instead; the two differ by at most one step.)
"""

from __future__ import annotations

import base64
import binascii
import io
import struct

import numpy as np
import soundfile as sf

from .errors import FieldError
from .settings import MAX_UPLOAD_BYTES

PCM16_BYTES = 2


def pcm16(samples: np.ndarray) -> bytes:
    """Mono float32 samples in [-1, 1] as raw little-endian PCM16."""
    buffer = io.BytesIO()
    sf.write(buffer, samples, 1, format="RAW", subtype="PCM_16", endian="LITTLE")
    return buffer.getvalue()


def streaming_wav_header(sample_rate: int) -> bytes:
    """A mono PCM16 WAV header for a stream of unknown length: RIFF and data sizes 0xFFFFFFFF, as
    streaming TTS services send (decoders read to the end of the stream)."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * PCM16_BYTES,
                                    PCM16_BYTES, 8 * PCM16_BYTES)
            + b"data" + struct.pack("<I", unknown))


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
