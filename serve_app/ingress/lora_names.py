"""The ingress's LoRA adapters: which `model` values name one ('base:adapter' or the
adapter's own name) and its directory, checked once when it becomes servable."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ray.serve.handle import DeploymentHandle

from engine.core.errors import InvalidParam
from engine.core.lora_config import LoRAConfig
from engine.lora.adapter import read_adapter
from engine.model.loader import DecoderSpec
from engine.model.model_source import local_checkpoint
from serve_app.openai.errors import OpenAIError


class AdapterNames:
    def __init__(
        self, base: str, config: LoRAConfig, spec: DecoderSpec, board: DeploymentHandle | None
    ) -> None:
        self.base, self.config, self.spec, self.board = base, config, spec, board

    async def resolve(self, model: str) -> tuple[str, str] | None:
        """None for the base model; (name, directory) for an adapter; else a 404 naming it."""
        if model == self.base:
            return None
        name = model.removeprefix(f"{self.base}:")
        if self.board is not None and name:
            path = await self.board.get.remote(name)
            if path is None and self._searched(name) is not None:
                path = await self.load(name, str(self._searched(name)))
            if path is not None:
                return name, path
        raise OpenAIError.model_not_found(model, [self.base])

    async def serves(self, name: str) -> bool:
        """Whether `name` is one of these adapters (loaded, or in the search path)."""
        if self.board is None or not name or ":" in name or "/" in name:
            return False
        return self._searched(name) is not None or await self.board.get.remote(name) is not None

    async def listed(self) -> dict[str, str]:
        """Every adapter a request may name now: loaded ones and the search path's."""
        if self.board is None:
            return {}
        found = {}
        root = self.config.search_path
        if root is not None and Path(root).is_dir():
            found = {p.name: str(p) for p in sorted(Path(root).iterdir()) if p.is_dir()}
        return found | await self.board.all.remote()

    async def load(self, name: str, path: str) -> str:
        """Check the adapter against the base model, then serve it (400 naming the fault)."""
        if self.board is None:
            raise OpenAIError(400, "LoRA is not enabled (engine.lora.enabled)", "lora_name")
        if not name or ":" in name or "/" in name or name == self.base:
            message = f"lora_name: {name!r} must be a new name without ':' or '/'"
            raise OpenAIError(400, message, "lora_name")
        try:  # a Hub id or a bucket: fetched on this node first (the engines fetch it too)
            local = await asyncio.to_thread(local_checkpoint, path, "lora_path")
            if not Path(local).is_dir():
                raise InvalidParam("lora_path", f"lora_path: {path!r} is not a directory")
            await asyncio.to_thread(read_adapter, local, self.spec, self.config.max_lora_rank)
        except InvalidParam as exc:
            raise OpenAIError.bad_request(exc) from None
        await self.board.add.remote(name, path)
        return path

    async def unload(self, name: str) -> None:
        if self.board is None or not await self.board.remove.remote(name):
            message = f"The LoRA adapter `{name}` is not loaded"
            raise OpenAIError(404, message, "lora_name", code="model_not_found")

    def _searched(self, name: str) -> Path | None:
        root = self.config.search_path
        if root is None or name in (".", ".."):
            return None
        path = Path(root) / name
        return path if path.is_dir() else None
