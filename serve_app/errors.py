"""HTTP errors in OpenAI's error body; the `param` of a client's mistake comes as data."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from engine.core.errors import InvalidParam
from serve_app import openai_protocol as oai


class OpenAIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        err_type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.err_type, self.code, self.headers = err_type, code, headers

    @classmethod
    def bad_request(cls, exc: InvalidParam) -> OpenAIError:
        return cls(400, str(exc), param=exc.param)

    @classmethod
    def server_error(cls, status: int, message: str) -> OpenAIError:
        return cls(status, message, err_type="server_error")

    def response(self) -> JSONResponse:
        body = oai.error_body(self.message, self.err_type, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request body"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type names to the path; keep only the field names.
    param = ".".join(p for p in loc if not p.startswith(("list[", "str", "int"))) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if first.get("type") == "extra_forbidden":
        message = f"{param}: unknown or unsupported field"
    return JSONResponse(oai.error_body(message, param=param), status_code=400)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
