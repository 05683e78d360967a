"""The LoRA adapters an engine serves, by name: configured ones, those found under the search
path when first asked for, and those loaded and unloaded at run time."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from engine.core.errors import InvalidParam, UnknownModel
from engine.core.lora_config import LoRAConfig
from engine.core.lora_slots import LoRARequest
from engine.lora.adapter import LoRAAdapter, read_adapter
from engine.model.loader import DecoderSpec
from engine.model.model_source import local_checkpoint


class LoRARegistry:
    def __init__(
        self,
        config: LoRAConfig,
        spec: DecoderSpec,
        on_read: Callable[[int, LoRAAdapter], None] | None = None,
    ) -> None:
        """Check and register the configured adapters (InvalidParam names what is wrong).
        `on_read` gets each adapter read (the runner's host cache: no second read)."""
        self.config, self.spec, self.on_read = config, spec, on_read
        self._adapters: dict[str, LoRARequest] = {}
        self._sources: dict[str, str] = {}  # name -> the path or id it was added from
        self._num_added = 0
        self._lock = threading.Lock()  # requests resolve names in threads of their own
        for name, path in config.adapters.items() if config.enabled else ():
            self.add(name, path)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def add(self, name: str, path: str) -> LoRARequest:
        """Register (or re-register) `name` from `path`, read and checked first."""
        if not self.config.enabled:
            raise InvalidParam("lora_name", "lora_name: LoRA is not enabled (lora.enabled)")
        if not name or ":" in name or "/" in name:
            raise InvalidParam("lora_name", f"lora_name: {name!r} must be a name without : or /")
        local = local_checkpoint(path, "lora_path")  # a Hub id or a bucket: fetched first
        if not Path(local).is_dir():
            raise InvalidParam("lora_path", f"lora_path: {path!r} is not a directory")
        adapter = read_adapter(local, self.spec, self.config.max_lora_rank)
        with self._lock:
            self._num_added += 1
            lora = LoRARequest(name, self._num_added, local)
            self._adapters[name] = lora
            self._sources[name] = path
        if self.on_read is not None:
            self.on_read(lora.lora_id, adapter)
        return lora

    def remove(self, name: str) -> None:
        """New requests cannot name it; requests already running it finish with it."""
        with self._lock:
            self._sources.pop(name, None)
            if self._adapters.pop(name, None) is None:
                raise UnknownModel(name, f"The LoRA adapter `{name}` is not loaded")

    def holds(self, name: str, path: str) -> bool:
        with self._lock:
            return self._sources.get(name) == path

    def resolve(self, name: str, path: str | None = None) -> LoRARequest:
        """The adapter served as `name`: registered, or a directory of the search path; with
        `path` (the ingress's), the adapter there, registered now if not yet."""
        if not self.config.enabled:
            raise UnknownModel(name, f"The model `{name}` does not exist (LoRA is not enabled)")
        with self._lock:
            lora = self._adapters.get(name)
            source = self._sources.get(name)
        if path is not None and (lora is None or source != path):
            return self.add(name, path)
        if lora is not None:
            return lora
        root = self.config.search_path
        if root is not None and "/" not in name and name not in (".", ".."):
            path = Path(root) / name
            if path.is_dir():
                return self.add(name, str(path))
        raise UnknownModel(name, f"The model `{name}` does not exist (no such LoRA adapter)")
