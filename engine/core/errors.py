"""The error a caller's bad value raises: it names the field as data, not only in its text."""

from __future__ import annotations


class InvalidParam(ValueError):
    """A bad value of one field (a request's or a configuration's). `param` is the field's
    name as the caller spelt it (OpenAI's error `param`; a config key); the message reads
    on its own."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class UnknownModel(InvalidParam):
    """A request names a model (a LoRA adapter) this engine does not serve: OpenAI's 404
    model_not_found."""

    def __init__(self, model: str, message: str) -> None:
        super().__init__("model", message)
        self.model = model
