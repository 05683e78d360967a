"""HTTP errors in OpenAI's error body; the `param` of a client's mistake comes as data."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.errors import InvalidParam
from serve_app.openai import protocol as oai


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
    def model_not_found(cls, model: str, served: list[str]) -> OpenAIError:
        listed = ", ".join(f"`{name}`" for name in served)
        message = f"The model `{model}` does not exist; this server serves {listed}"
        return cls(404, message, param="model", code="model_not_found")

    @classmethod
    def too_long(cls, param: str, max_model_len: int, prompt: int, completion: int) -> OpenAIError:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt + completion} tokens ({prompt} in the prompt, {completion} for "
            "the completion)."
        )
        return cls(400, message, param=param, code="context_length_exceeded")

    @classmethod
    def server_error(cls, status: int, message: str) -> OpenAIError:
        return cls(status, message, err_type="server_error")

    def response(self) -> JSONResponse:
        body = oai.error_body(self.message, self.err_type, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


def validation_error_response(errors: list[dict]) -> JSONResponse:
    """A 400 for a body that failed to parse or validate (pydantic's error list, FastAPI's
    `body` prefix on each location or not), naming the first error's field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", first.get("msg"))
        message = f"the request body is not valid JSON ({reason})"
        return JSONResponse(oai.error_body(message), status_code=400)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type names to the path; keep only the field names.
    param = ".".join(p for p in loc if not p.startswith(("list[", "str", "int"))) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if first.get("type") == "extra_forbidden":
        message = f"{param}: unknown or unsupported field"
    return JSONResponse(oai.error_body(message, param=param), status_code=400)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error_response(list(exc.errors()))


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own errors (unknown route, wrong method, an unparsable body) in OpenAI's body
    instead of `{"detail": ...}`."""
    err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = oai.error_body(str(exc.detail), err_type)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
