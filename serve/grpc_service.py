"""The gRPC service `cosyvoice.CosyVoice` (upstream's streamed `Inference`) over the engine and session queue
that HTTP uses.

A request's kind is the member of its `RequestPayload` oneof that it sets. CosyVoice3 synthesises three:
`zero_shot_request`, `cross_lingual_request` and `instruct2_request` (ours, oneof field 5: upstream's .proto
has no instruct2). Upstream's `sft_request` and `instruct_request` name a built-in speaker of `spk2info.pt`,
which runtime bundles do not have; they are answered UNIMPLEMENTED. A prompt comes as PCM16 at 16 kHz
(upstream's client resamples and converts it so); it is wrapped in a WAV file and extracted as an HTTP
upload is. The text is prepared as upstream's CosyVoice3 servers prepare it (`Engine.stream`), and every
chunk the runtime streams goes back as one `Response` of PCM16 at 24 kHz, converted as HTTP converts it:
the samples of `cosyvoice-run --stream` for the same input.

Statuses: bad input is INVALID_ARGUMENT with a one-line message naming the field as the .proto does
(`zero_shot_request.tts_text is empty`), bytes that are no `cosyvoice.Request` too (`parse_request`:
protobuf's error raised in grpc's deserializer would be UNKNOWN, with a traceback in the log; a text field
that is not UTF-8 is named, where protobuf names none); a full
queue RESOURCE_EXHAUSTED at once; the server's timeout DEADLINE_EXCEEDED. A client that cancels,
disconnects or passes its own deadline has its handler cancelled by grpc, which cancels its session,
queued or running. An error after some audio ends the stream with its
status (unlike HTTP, gRPC has a status after the body). Sampling: the server's (`--sampling`), seeded by
the request metadata `seed`, else `--seed`, else a random seed; the initial metadata sends it back as
`x-seed`, with `x-sample-rate`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from cosyvoice_runtime.audio_files import PCM16_BYTES, pcm16
from cosyvoice_runtime.errors import FrontendError
from cosyvoice_runtime.frontend.audio import PromptAudio, check_prompt_audio
from cosyvoice_runtime.sampling import MAX_SEED
from cosyvoice_runtime.synthesis import Mode

from .engine import AudioUpload, Engine, SynthesisJob
from .errors import ApiError, FieldError
from .forms import undecodable
from .metrics import ServerMetrics
from .proto import cosyvoice_pb2, cosyvoice_pb2_grpc
from .queue import QueueFull, ServerStopping, SessionQueue
from .responses import record_session, request_sampling, require_text
from .settings import ServerSettings

log = logging.getLogger(__name__)

PAYLOAD = "RequestPayload"
"""The request's oneof: which kind of synthesis it asks for."""
PROMPT_SAMPLE_RATE = 16000
"""Sample rate of `prompt_audio` (PCM16), as upstream's client sends it."""
SEED_KEY = "seed"
"""Request metadata: the sampler's seed (not upstream's)."""
NEEDS_SPK2INFO = {
    "sft_request": "sft_request needs a built-in speaker of upstream's spk2info.pt, which CosyVoice3 "
                   "runtime bundles do not have; send zero_shot_request, cross_lingual_request or "
                   "instruct2_request",
    "instruct_request": "instruct_request (CosyVoice-300M's instruct) needs a built-in speaker of "
                        "spk2info.pt; for CosyVoice3 send instruct2_request (tts_text, instruct_text, "
                        "prompt_audio)",
}
STATUS_CODES = {404: grpc.StatusCode.NOT_FOUND, 501: grpc.StatusCode.UNIMPLEMENTED,
                503: grpc.StatusCode.RESOURCE_EXHAUSTED, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
"""gRPC codes of the HTTP statuses that have their own; other 4xx are INVALID_ARGUMENT, 5xx INTERNAL (a
stopping server, 503 as a full queue, is UNAVAILABLE: try another)."""


class Unimplemented(ApiError):
    """A request kind this model cannot serve: 501, UNIMPLEMENTED."""

    def __init__(self, detail: str) -> None:
        super().__init__(501, detail)


def status_code(error: ApiError) -> grpc.StatusCode:
    """The gRPC status code of an `ApiError`."""
    if isinstance(error, ServerStopping):
        return grpc.StatusCode.UNAVAILABLE
    if error.status in STATUS_CODES:
        return STATUS_CODES[error.status]
    return grpc.StatusCode.INVALID_ARGUMENT if error.status < 500 else grpc.StatusCode.INTERNAL


AUDIO_FILE_MAGIC = {b"RIFF": "a WAV", b"fLaC": "a FLAC", b"OggS": "an Ogg", b"ID3": "an MP3"}
"""How audio files begin: a `prompt_audio` that begins so is a file, not samples (as upstream, whose server
would take its header and compressed bytes as samples)."""


@dataclass(frozen=True)
class Malformed:
    """Bytes of a call that are not a `cosyvoice.Request`: why, as protobuf says."""

    reason: str


def parse_request(data: bytes) -> cosyvoice_pb2.Request | Malformed:
    """The service's request deserializer: the request, or `Malformed`, which `Inference` refuses (naming a
    text field whose bytes are not UTF-8, where protobuf's parser names none)."""
    try:
        return cosyvoice_pb2.Request.FromString(data)
    except DecodeError as e:
        try:
            named = not_utf8(REQUEST_TEXT_AS_BYTES.FromString(data), cosyvoice_pb2.Request.DESCRIPTOR)
        except DecodeError:
            named = None
        return Malformed(named or str(e))


def text_as_bytes(descriptor: Descriptor) -> type[Message]:
    """The message of `descriptor` with every string field of its file read as bytes, in a descriptor pool
    of its own: bytes that fail only protobuf's UTF-8 check parse as it, so that the field can be named."""
    proto = descriptor_pb2.FileDescriptorProto()
    descriptor.file.CopyToProto(proto)
    for message in proto.message_type:  # cosyvoice.proto nests no message in another's declaration
        for field in message.field:
            if field.type == field.TYPE_STRING:
                field.type = field.TYPE_BYTES
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(descriptor.full_name))


REQUEST_TEXT_AS_BYTES = text_as_bytes(cosyvoice_pb2.Request.DESCRIPTOR)


def not_utf8(message: Message, declared: Descriptor, path: str = "") -> str | None:
    """The first field declared a string (in `declared`) whose bytes in `message` (`text_as_bytes`'s) are
    not UTF-8, named as the .proto does, with where its bytes fail; None where every text decodes."""
    for field, value in message.ListFields():  # cosyvoice.proto has no repeated fields
        name, own = f"{path}{field.name}", declared.fields_by_name[field.name]
        if own.message_type is not None:
            if (found := not_utf8(value, own.message_type, f"{name}.")) is not None:
                return found
        elif own.type == FieldDescriptor.TYPE_STRING:
            try:
                value.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{name}: not UTF-8 text ({undecodable(e)})"
    return None


def prompt_upload(data: bytes, field: str) -> AudioUpload:
    """A `prompt_audio` (PCM16 at 16 kHz) as a prompt recording, checked as an uploaded file is: a
    `FieldError` naming `field` if it cannot prompt."""
    if not data:
        raise FieldError(field, f"{field} is empty; send the prompt recording as 16 kHz mono PCM16 "
                                "(int16 bytes)")
    kind = next((name for magic, name in AUDIO_FILE_MAGIC.items() if data.startswith(magic)), None)
    if kind is not None:
        raise FieldError(field, f"{field} holds {kind} file; send the recording's samples: 16 kHz mono "
                                "PCM16 (int16 bytes), as upstream's client does")
    if len(data) % PCM16_BYTES:
        raise FieldError(field, f"{field} has {len(data)} bytes, not a whole number of 16-bit samples")
    # as soundfile reads PCM16: each sample over 2**15, exact in float32
    samples = np.frombuffer(data, "<i2").astype(np.float32) / np.float32(1 << 15)
    audio = PromptAudio(samples, PROMPT_SAMPLE_RATE, "the recording")
    try:
        check_prompt_audio(audio)
    except FrontendError as e:
        raise FieldError(field, str(e)) from None
    return AudioUpload(audio, field)


def request_seed(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The `seed` of the request metadata, if it has one (an integer from 0 to `MAX_SEED`, as HTTP's)."""
    values = [value for key, value in metadata or () if key == SEED_KEY]
    if not values:
        return None
    text = values[-1].decode() if isinstance(values[-1], bytes) else values[-1]
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit()) or int(digits) > MAX_SEED:
        raise FieldError(SEED_KEY, f"seed metadata must be an integer from 0 to {MAX_SEED}, got {text!r}")
    return int(digits)


def synthesis_job(request: cosyvoice_pb2.Request, settings: ServerSettings, seed: int | None
                  ) -> SynthesisJob:
    """The job `request` asks for: a `FieldError` for bad input, `Unimplemented` for spk2info kinds."""
    kind = request.WhichOneof(PAYLOAD)
    if kind is None:
        raise FieldError(PAYLOAD, f"{PAYLOAD} is empty: set zero_shot_request, cross_lingual_request or "
                                  "instruct2_request")
    if kind in NEEDS_SPK2INFO:
        raise Unimplemented(NEEDS_SPK2INFO[kind])
    sampling = request_sampling(settings, seed)
    text_field = f"{kind}.tts_text"

    def text(value: str, field: str) -> str:
        return require_text(value, f"{kind}.{field}", settings)

    if kind == "zero_shot_request":
        zero_shot = request.zero_shot_request
        return SynthesisJob(Mode.ZERO_SHOT, text(zero_shot.tts_text, "tts_text"),
                            prompt_upload(zero_shot.prompt_audio, f"{kind}.prompt_audio"), sampling,
                            prompt_text=text(zero_shot.prompt_text, "prompt_text"), text_field=text_field)
    if kind == "cross_lingual_request":
        cross_lingual = request.cross_lingual_request
        return SynthesisJob(Mode.CROSS_LINGUAL, text(cross_lingual.tts_text, "tts_text"),
                            prompt_upload(cross_lingual.prompt_audio, f"{kind}.prompt_audio"), sampling,
                            text_field=text_field)
    instruct2 = request.instruct2_request
    return SynthesisJob(Mode.INSTRUCT2, text(instruct2.tts_text, "tts_text"),
                        prompt_upload(instruct2.prompt_audio, f"{kind}.prompt_audio"), sampling,
                        instruct=text(instruct2.instruct_text, "instruct_text"), text_field=text_field)


class CosyVoiceService(cosyvoice_pb2_grpc.CosyVoiceServicer):
    """`cosyvoice.CosyVoice` over `engine`, its sessions admitted to `sessions` (HTTP's, so that both share
    one concurrency limit), else to a queue of its own bounded by `settings`. Beside HTTP, its calls count
    in HTTP's `metrics` as the synthesis routes' requests do (alone, no endpoint would show them)."""

    def __init__(self, engine: Engine, settings: ServerSettings, sessions: SessionQueue | None = None,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.sessions = sessions if sessions is not None else SessionQueue(
            settings.sessions_at_once(engine.max_batch), settings.queue_depth, settings.timeout)

    def add_to(self, server: grpc.aio.Server) -> None:
        """Serve this service's one method on `server`, its requests read by `parse_request`."""
        handlers = {"Inference": grpc.unary_stream_rpc_method_handler(
            self.Inference, request_deserializer=parse_request,
            response_serializer=cosyvoice_pb2.Response.SerializeToString)}
        name = cosyvoice_pb2.DESCRIPTOR.services_by_name["CosyVoice"].full_name
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)

    async def Inference(self, request: cosyvoice_pb2.Request | Malformed,
                        context: grpc.aio.ServicerContext) -> None:
        """Synthesise `request`, writing each streamed chunk's PCM16 as one `Response`."""
        metrics = self.metrics
        if metrics is not None:
            metrics.requests_total.inc()
        try:
            if isinstance(request, Malformed):
                raise ApiError(400, f"the call's bytes are not a cosyvoice.Request: {request.reason}")
            # on a worker thread: checking a prompt's samples takes a while, and the loop serves HTTP too
            job = await asyncio.to_thread(synthesis_job, request, self.settings,
                                          request_seed(context.invocation_metadata()))
            start = time.monotonic()
            self.sessions.check_room()  # before the text is normalised, as HTTP's `responses.submit`
            pieces = await self.engine.text_segments(job, self.settings.timeout)
            stream = self.sessions.submit(lambda session: self.engine.stream(job, pieces, session))
        except ApiError as e:
            if metrics is not None:
                if isinstance(e, QueueFull):
                    metrics.requests_rejected.inc()
                metrics.requests_error.inc()
            log.info("Inference refused: %s", e.detail)
            await context.abort(status_code(e), e.detail)
            return
        chunks = samples = 0
        try:
            await context.send_initial_metadata((("x-seed", str(job.sampling.seed)),
                                                 ("x-sample-rate", str(self.engine.sample_rate))))
            while (chunk := await stream.next()) is not None:
                if chunks == 0 and metrics is not None:
                    metrics.first_chunk_seconds.observe(time.monotonic() - start)
                chunks, samples = chunks + 1, samples + len(chunk)
                await context.write(cosyvoice_pb2.Response(tts_audio=pcm16(chunk)))
        except asyncio.CancelledError:  # the client went away: neither a success nor an error
            if metrics is not None:
                metrics.sessions_cancelled.inc()
            raise
        except ApiError as e:
            if metrics is not None:
                metrics.requests_error.inc()
            log.info("Inference failed: %s", e.detail)
            await context.abort(status_code(e), e.detail)
        except Exception as e:
            if metrics is not None:
                metrics.requests_error.inc()
            log.exception("Inference failed")
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"internal error ({type(e).__name__}); the server keeps serving")
        else:
            if metrics is not None:
                metrics.requests_success.inc()
                record_session(metrics, stream.session, samples, self.engine.sample_rate)
        finally:
            stream.cancel()  # a no-op once the work has ended; else (grpc cancelled us) it stops the session
