"""The server's error type and how every error reaches the client: a status and a one-line JSON body.

Bodies are `{"detail": ..., "error": ..., "code": ...}`: `detail` is FastAPI's convention, `error` and
`code` the bridge server's `ErrorResponse`, so clients of either read them unchanged. Under `/v1/`, OpenAI's
API, they are OpenAI's `{"error": {"message", "type", "param", "code"}}`, which its SDKs and the clients
built on them read (their exceptions carry the message). A `detail` names the request field at fault.
Nothing answers with a traceback: an unexpected exception is logged once, with its traceback, and answers
500 with its type only (or, after the status line, ends the response unfinished).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .forms import FieldNotText, undecodable

OUTCOME = "synthesis_outcome"
"""`request.state` key: `CANCELLED` when the client went away (the metrics middleware reads it)."""
CANCELLED = "cancelled"

log = logging.getLogger(__name__)


class ErrorBody(BaseModel):
    """An error's JSON body outside `/v1/` (`error_response`), as the API schema states it."""

    detail: str = Field(description="What is wrong, in one line, naming the request field at fault.")
    error: str = Field(description="The same line (the bridge server's field).")
    code: int = Field(description="The HTTP status.")


class OpenAIError(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    """An error's JSON body under `/v1/`: OpenAI's."""

    error: OpenAIError


def error_responses(*statuses: int, openai: bool = False) -> dict[int | str, dict[str, Any]]:
    """The API schema's `responses` for errors of `statuses`, in `error_response`'s body: FastAPI's default
    422 (its validation error list) would describe a body the server never sends."""
    model = OpenAIErrorBody if openai else ErrorBody
    return {status: {"model": model, "description": HTTPStatus(status).phrase} for status in statuses}


def audio_response(description: str, *media_types: str) -> dict[int | str, dict[str, Any]]:
    """The API schema's 200 of a route answering audio (bytes, in one of `media_types`)."""
    content = {media: {"schema": {"type": "string", "format": "binary"}} for media in media_types}
    return {200: {"description": description, "content": content}}


class ApiError(Exception):
    """An error with its HTTP status and one-line detail."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = " ".join(detail.split())
        self.headers = headers
        self.param = param
        """The request field at fault, where one is."""


class FieldError(ApiError):
    """Bad input in request field `field`; the detail starts with the field's name (prefixed if need be)."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(status, message if message.startswith(field) else f"{field}: {message}", param=field)


class EmptyField(FieldError):
    """A request field that is empty or blank: one answer for both, whether the field came as JSON or as
    a form field (which FastAPI, when empty, takes for a missing one)."""

    def __init__(self, field: str) -> None:
        super().__init__(field, f"{field} is empty")


class StreamCut(Exception):
    """A streamed response ended unfinished after its status line; the reason is logged already."""


OPENAI_PREFIX = "/v1/"
"""The routes of OpenAI's API, whose errors take OpenAI's shape."""


def error_response(status: int, detail: str, headers: Mapping[str, str] | None = None, *, path: str = "",
                   param: str | None = None) -> JSONResponse:
    """The JSON error body of a request to `path`: OpenAI's shape under `/v1/`, else ours; `param` is the
    request field at fault, where one is."""
    if path.startswith(OPENAI_PREFIX):
        kind = ("server_error" if status >= 500 else "rate_limit_error" if status == 429 else
                "invalid_request_error")
        code = "invalid_api_key" if status == 401 else None
        body: dict[str, object] = {"error": {"message": detail, "type": kind, "param": param, "code": code}}
    else:
        body = {"detail": detail, "error": detail, "code": status}
    return JSONResponse(body, status_code=status, headers=headers)


def _empty_form_fields(error: RequestValidationError) -> list[str]:
    """The fields FastAPI calls missing that the form does hold, empty."""
    if not isinstance(error.body, FormData):
        return []
    return [str(item["loc"][1]) for item in error.errors()
            if item.get("type") == "missing" and len(item.get("loc", ())) == 2 and item["loc"][0] == "body"
            and error.body.get(str(item["loc"][1])) == ""]


FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


def _wrong_content_type(request: Request, error: RequestValidationError) -> str | None:
    """Where a body was not read for its Content-Type, the line saying so: a JSON route leaves a body of any
    other type unparsed (bytes), a form route finds no fields in one that is no form."""
    sent = (request.headers.get("content-type") or "none")[:80]
    if isinstance(error.body, bytes | bytearray):
        return f"body: expected Content-Type application/json, got {sent}"
    form = sent.split(";")[0].strip().lower() in FORM_TYPES
    if (isinstance(error.body, FormData) and not error.body and not form
            and all(item.get("type") == "missing" for item in error.errors())):
        return f"body: expected Content-Type {' or '.join(FORM_TYPES)}, got {sent}"
    return None


def _json_failure(error: ValueError | RecursionError) -> str:
    """Why a body that is no JSON syntax error is not JSON either: its bytes, its depth, or a number Python
    will not read (an integer of more than 4300 digits)."""
    if isinstance(error, RecursionError):
        return "nested too deeply"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8: {undecodable(error)}"
    if digits := re.search(r"integer string conversion: value has (\d+) digits", str(error)):
        return f"a number of {digits[1]} digits; at most {sys.get_int_max_str_digits()} are read"
    return " ".join(str(error).split())


def _validation_detail(error: RequestValidationError) -> str:
    """FastAPI's validation errors as one line: `field: message; field: message`."""
    parts = []
    for item in error.errors():
        if item.get("type") == "json_invalid":  # loc is ("body", offset): say where and why
            reason = item.get("ctx", {}).get("error", "invalid")
            parts.append(f"body: not valid JSON ({reason} at character {item['loc'][-1]})")
            continue
        loc = [str(p) for p in item.get("loc", ()) if p not in ("body", "query", "path")]
        message = item.get("msg", "invalid")
        if message.startswith("Value error, Expected UploadFile"):  # FastAPI's words for a text field
            message = "expected an uploaded file, got a text field"
        parts.append(f"{'.'.join(loc) or 'body'}: {message}")
    return "; ".join(parts) or "invalid request"


def _first_field(error: RequestValidationError) -> str | None:
    """The request field of FastAPI's first validation error, where it names one."""
    for item in error.errors():
        loc = [str(p) for p in item.get("loc", ()) if p not in ("body", "query", "path")]
        if loc and item.get("type") != "json_invalid":
            return ".".join(loc)
    return None


def install_error_handlers(app: FastAPI) -> None:
    """Answer `ApiError`, validation errors, Starlette's HTTP errors and anything unexpected alike."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc.status, exc.detail, exc.headers, path=request.url.path, param=exc.param)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        empty = _empty_form_fields(exc)
        if empty:  # answered as a blank field is (`EmptyField`), before any other fault
            return error_response(400, EmptyField(empty[0]).detail, path=request.url.path, param=empty[0])
        if wrong_type := _wrong_content_type(request, exc):
            return error_response(415, wrong_type, path=request.url.path)
        return error_response(422, _validation_detail(exc), path=request.url.path, param=_first_field(exc))

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        path = request.url.path
        if isinstance(exc.__cause__, ClientDisconnect):  # gone mid-upload: neither a success nor an error
            setattr(request.state, OUTCOME, CANCELLED)
        # what json.loads raises besides a syntax error, which FastAPI answers with a bare 400: answered as
        # a syntax error is (422, `_validation_detail`)
        if isinstance(exc.__cause__, ValueError | RecursionError):
            return error_response(422, f"body: not valid JSON ({_json_failure(exc.__cause__)})", path=path)
        if isinstance(exc.__context__, FieldNotText):
            return error_response(400, exc.__context__.message, path=path, param=exc.__context__.field)
        detail = " ".join(str(exc.detail).split())
        if isinstance(exc.__context__, MultiPartException):  # Starlette's form parser turned it into a 400
            detail = f"body: malformed multipart/form-data ({detail.rstrip('.')})"
        return error_response(exc.status_code, detail, exc.headers, path=path)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)


UNFINISHED = "ASGI callable returned without completing response."
"""What uvicorn logs (an ERROR, on `uvicorn.error`) when an app returns from a response it did not finish;
uvicorn then closes the connection, which is how a client learns that its stream was cut."""
_stream_cut: ContextVar[bool] = ContextVar("stream_cut", default=False)
"""Set in the request's context when `AnswerUnexpected` ends a cut stream: uvicorn logs `UNFINISHED` in that
context (the same task, just after the app returns)."""


class CutStreamLogged(logging.Filter):
    """Drops uvicorn's `UNFINISHED` line for a stream whose cut was logged already (`StreamCut`), so that a
    cut is one line; any other unfinished response keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == UNFINISHED and _stream_cut.get())


CUT_STREAM_LOGGED = CutStreamLogged()


class AnswerUnexpected:
    """ASGI middleware: an exception nothing else answered is logged once and answered 500, or, after the
    status line, ends the response unfinished (the server then closes the connection).

    Starlette's own last resort (an `Exception` handler) answers and then raises the exception again
    for the server, which logs it a second time; this one keeps it. A stream cut (`StreamCut`) ends
    unfinished without a second line from uvicorn (`CutStreamLogged`).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        logging.getLogger("uvicorn.error").addFilter(CUT_STREAM_LOGGED)  # a logger keeps one filter once

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except StreamCut:  # logged where it was cut; the server closes the unfinished response
            _stream_cut.set(True)
        except Exception as e:
            log.exception("%s %s failed", scope["method"], scope["path"])
            if not started:
                detail = f"internal error ({type(e).__name__}); the server keeps serving"
                await error_response(500, detail, path=scope["path"])(scope, receive, send)
