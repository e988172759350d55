"""The response formats of `/v1/audio/speech`, each written chunk by chunk as the audio is synthesised.

`pcm` and `wav` are the PCM16 of `cosyvoice_runtime.audio_files.pcm16` (a stream's WAV header gives its
sizes as unknown); `mp3`, `opus` (in Ogg), `aac` (in ADTS) and `flac` are encoded by FFmpeg through PyAV
from that same PCM16, so FLAC holds exactly the WAV's samples. A stream's container is written to a sink
that cannot seek, which every one of these muxers supports: what it cannot go back to fill in (MP3's
Xing/LAME header with the encoder's delay and padding, FLAC's total length and MD5) is left out, as in any
live stream. A whole file (`encode_whole`) is written to memory that can seek, so it has them. Ogg pages
are flushed every 20 ms of audio instead of every second, so an Opus stream leaves with each chunk.

`sse` wraps any of them in OpenAI's server-sent events: `speech.audio.delta` with the base64 of the bytes
a chunk added, then `speech.audio.done` with the tokens the LLM read and generated.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import av
import numpy as np

from cosyvoice_runtime.audio_files import pcm16, streaming_wav_header, wav_bytes

from .engine import TokenUsage

FormatName = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
Codec = Literal["libmp3lame", "libopus", "aac", "flac"]
"""FFmpeg's encoders of the compressed formats."""
SSE_MEDIA_TYPE = "text/event-stream"


class ChunkEncoder(Protocol):
    """Turns an utterance's chunks of float32 samples into the bytes of one response body, in order."""

    def encode(self, samples: np.ndarray) -> bytes:
        """The bytes `samples` complete (possibly none: an encoder may hold a frame back)."""
        ...

    def finish(self) -> bytes:
        """The rest of the body, once every chunk is encoded."""
        ...

    def close(self) -> None:
        """Release the encoder, finished or not (a cut stream)."""
        ...


@dataclass(frozen=True)
class Ffmpeg:
    """How FFmpeg writes a compressed format."""

    muxer: str
    """The container (PyAV's `format`)."""
    codec: Codec
    bit_rate: int | None = None
    """None: the encoder's own choice (FLAC's is lossless)."""
    options: Mapping[str, str] = field(default_factory=dict)
    """The muxer's options."""


@dataclass(frozen=True)
class AudioFormat:
    """One `response_format`: its media type and how it is written."""

    name: FormatName
    media_type: str
    ffmpeg: Ffmpeg | None = None
    """None for `pcm` and `wav`, which are PCM16 written here."""

    def encoder(self, sample_rate: int) -> ChunkEncoder:
        """An encoder for a stream of unknown length."""
        if self.ffmpeg is not None:
            return AvEncoder(self.ffmpeg, sample_rate, _Sink())
        return PcmEncoder(streaming_wav_header(sample_rate) if self.name == "wav" else b"")

    def encode_whole(self, samples: np.ndarray, sample_rate: int) -> bytes:
        """A complete file of `samples` (its length known: the WAV header and MP3's LAME tag say it)."""
        if self.ffmpeg is None:
            return wav_bytes(samples, sample_rate) if self.name == "wav" else pcm16(samples)
        buffer = io.BytesIO()
        encoder = AvEncoder(self.ffmpeg, sample_rate, buffer)
        try:
            encoder.encode(samples)
            encoder.finish()
        finally:
            encoder.close()
        return buffer.getvalue()


FORMATS: dict[str, AudioFormat] = {f.name: f for f in (
    AudioFormat("mp3", "audio/mpeg", Ffmpeg("mp3", "libmp3lame", 64_000)),
    # RFC 7845's media type for Opus in Ogg, which browsers play; pages of 20 ms (in microseconds)
    AudioFormat("opus", "audio/ogg; codecs=opus",
                Ffmpeg("ogg", "libopus", 32_000, {"page_duration": "20000"})),
    AudioFormat("aac", "audio/aac", Ffmpeg("adts", "aac", 64_000)),
    AudioFormat("flac", "audio/flac", Ffmpeg("flac", "flac")),
    AudioFormat("wav", "audio/wav"),
    AudioFormat("pcm", "audio/pcm"),
)}
"""Every `response_format` by name (OpenAI's six)."""


class PcmEncoder:
    """Raw PCM16, after `header` (a streaming WAV header, for `wav`)."""

    def __init__(self, header: bytes = b"") -> None:
        self._header = header

    def encode(self, samples: np.ndarray) -> bytes:
        data, self._header = self._header + pcm16(samples), b""
        return data

    def finish(self) -> bytes:
        data, self._header = self._header, b""
        return data

    def close(self) -> None:
        pass


class _Sink:
    """Where a streamed container is written: kept until taken, and without `seek`, so that FFmpeg writes
    it front to back."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


class AvEncoder:
    """FFmpeg's encoder and muxer (PyAV), fed the PCM16 of each chunk. PyAV converts the samples
    to the encoder's sample format and cuts them into its frame size."""

    def __init__(self, ffmpeg: Ffmpeg, sample_rate: int, sink: _Sink | io.BytesIO) -> None:
        """Opens nothing yet: a request refused before its first audio leaves no container to close."""
        self._ffmpeg, self._sample_rate, self._sink = ffmpeg, sample_rate, sink
        self._output: tuple[av.container.OutputContainer, av.AudioStream] | None = None
        self._samples = 0

    def encode(self, samples: np.ndarray) -> bytes:
        container, stream = self._open()
        pcm = np.frombuffer(pcm16(samples), "<i2")
        frame = av.AudioFrame.from_ndarray(pcm[np.newaxis], format="s16", layout="mono")  # (1, n)
        frame.sample_rate, frame.pts = self._sample_rate, self._samples
        self._samples += len(pcm)
        container.mux(stream.encode(frame))
        return self._take()

    def finish(self) -> bytes:
        container, stream = self._open()
        container.mux(stream.encode(None))
        self.close()
        return self._take()

    def close(self) -> None:
        if self._output is not None:
            self._output[0].close()
            self._output = None

    def _open(self) -> tuple[av.container.OutputContainer, av.AudioStream]:
        if self._output is not None:
            return self._output
        ffmpeg = self._ffmpeg
        container = av.open(self._sink, mode="w", format=ffmpeg.muxer, options=dict(ffmpeg.options))
        stream = container.add_stream(ffmpeg.codec, rate=self._sample_rate, layout="mono")
        if ffmpeg.bit_rate is not None:
            stream.bit_rate = ffmpeg.bit_rate
        self._output = container, stream
        return self._output

    def _take(self) -> bytes:
        return self._sink.take() if isinstance(self._sink, _Sink) else b""


class SseEncoder:
    """OpenAI's speech events around `inner`'s bytes: a `speech.audio.delta` for each piece, then
    `speech.audio.done` with `usage` (complete once the job's stream has ended)."""

    def __init__(self, inner: ChunkEncoder, usage: TokenUsage) -> None:
        self._inner, self._usage = inner, usage

    def encode(self, samples: np.ndarray) -> bytes:
        return _delta(self._inner.encode(samples))

    def finish(self) -> bytes:
        usage = {"input_tokens": self._usage.text_tokens, "output_tokens": self._usage.speech_tokens,
                 "total_tokens": self._usage.text_tokens + self._usage.speech_tokens}
        return _delta(self._inner.finish()) + _event({"type": "speech.audio.done", "usage": usage})

    def close(self) -> None:
        self._inner.close()


def _delta(data: bytes) -> bytes:
    return _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if data else b""


def _event(payload: dict[str, object]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
