"""Multipart forms whose text fields are read strictly in the body's charset (UTF-8 unless it names another).

Starlette decodes a text field that is not valid in the charset as Latin-1 without a word, which would turn
the bytes a client garbled into other text and synthesise it. The form routes (`route_class=FormRoute`)
read their forms with `StrictMultiPartParser` instead, which refuses such a field (400, naming it) while
the body is parsed, before any work. A URL-encoded form is left to Starlette: these routes all take an
upload, which only a multipart form carries. Starlette has no hook for this: the parser and the request
override its `on_part_end` and `_get_form` and read their state (`_current_part`, `_charset`, `_form`).
Where a Starlette renames them, the forms are read as Starlette reads them (which the server's tests of a
garbled field notice), never refused for it.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from contextlib import aclosing
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser

MULTIPART = "multipart/form-data"


def undecodable(error: UnicodeDecodeError) -> str:
    """Where and why bytes did not decode, for a one-line error."""
    return f"byte 0x{error.object[error.start]:02x} at offset {error.start}: {error.reason}"


class FieldNotText(MultiPartException):
    """A form's text field whose bytes are not valid in the body's charset."""

    def __init__(self, field: str, charset: str, error: UnicodeDecodeError) -> None:
        super().__init__(f"{field}: not {charset.upper()} text ({undecodable(error)})")
        self.field = field


class StrictMultiPartParser(MultiPartParser):
    """Starlette's multipart parser, but a text field that does not decode is `FieldNotText`."""

    def on_part_end(self) -> None:
        part, charset = getattr(self, "_current_part", None), getattr(self, "_charset", None)
        if part is not None and isinstance(charset, str) and charset and getattr(part, "file", True) is None:
            try:
                part.data.decode(charset)
            except UnicodeDecodeError as e:
                raise FieldNotText(part.field_name, charset, e) from None
        super().on_part_end()


class StrictFormRequest(Request):
    """A request whose multipart form is read by `StrictMultiPartParser` (any other body as Starlette's)."""

    async def _get_form(self, **limits: Any) -> FormData:
        content_type = self.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type == MULTIPART and hasattr(self, "_form") and self._form is None:
            try:
                async with aclosing(self.stream()) as stream:
                    self._form = await StrictMultiPartParser(self.headers, stream, **limits).parse()
            except MultiPartException as e:  # answered as Starlette answers its own (`errors.http_error`)
                raise HTTPException(400, detail=e.message) from e
        return await super()._get_form(**limits)


class FormRoute(APIRoute):
    """A route whose handler gets a `StrictFormRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def strict_form(request: Request) -> Response:
            return await handle(StrictFormRequest(request.scope, request.receive))

        return strict_form
