"""LoRABoard: the LoRA adapters an app serves, name -> directory, one table for every
ingress replica: the configured ones, then those loaded and unloaded at run time."""

from __future__ import annotations

from ray import serve


@serve.deployment(name="LoRABoard", num_replicas=1, max_ongoing_requests=1024)
class LoRABoard:
    def __init__(self, adapters: dict[str, str]) -> None:
        self._adapters = dict(adapters)

    async def get(self, name: str) -> str | None:
        return self._adapters.get(name)

    async def add(self, name: str, path: str) -> None:
        self._adapters[name] = path

    async def remove(self, name: str) -> bool:
        return self._adapters.pop(name, None) is not None

    async def all(self) -> dict[str, str]:
        return dict(self._adapters)
