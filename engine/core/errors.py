"""The error a caller's bad value raises: it names the field as data, not only in its text."""

from __future__ import annotations


class InvalidParam(ValueError):
    """A bad value of one field (a request's or a configuration's). `param` is the field's
    name as the caller spelt it (OpenAI's error `param`; a config key); the message reads
    on its own."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
