"""How a checkpoint's embeddings are made, as embedding models publish it: the
sentence-transformers files beside the weights (modules.json naming a Pooling module whose
config.json sets `pooling_mode_lasttoken` or `pooling_mode_mean_tokens`, and a Normalize
module), and Matryoshka dimensions in config.json (`matryoshka_dimensions`, or
`is_matryoshka`). A decoder without them pools its last token, normalized, as vLLM does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.core.errors import InvalidParam
from engine.core.sampling_params import Pooling


@dataclass(frozen=True)
class EmbeddingConfig:
    pooling: Pooling
    normalize: bool
    hidden_size: int
    # The dimensions a request may truncate to: None (no truncation), () (any up to
    # hidden_size), or the listed ones.
    matryoshka: tuple[int, ...] | None = None

    def check_dimensions(self, dimensions: int | None) -> None:
        """Raise InvalidParam naming `dimensions` unless this model allows it."""
        if dimensions is None or dimensions == self.hidden_size:
            return
        if self.matryoshka is None:
            raise InvalidParam(
                "dimensions", "dimensions: this model's embeddings cannot be truncated"
            )
        allowed = self.matryoshka or range(1, self.hidden_size + 1)
        if dimensions not in allowed:
            shown = list(self.matryoshka) if self.matryoshka else f"1 to {self.hidden_size}"
            raise InvalidParam("dimensions", f"dimensions: one of {shown}, got {dimensions}")


def read_embedding_config(model_dir: str | Path, hidden_size: int) -> EmbeddingConfig:
    root = Path(model_dir)
    pooling: Pooling = "last"
    normalize = True
    modules = _json(root / "modules.json")
    if isinstance(modules, list):
        kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
        normalize = "Normalize" in kinds
        if "Pooling" in kinds:
            spec = _json(root / kinds["Pooling"] / "config.json") or {}
            if spec.get("pooling_mode_mean_tokens"):
                pooling = "mean"
    config = _json(root / "config.json") or {}
    matryoshka = None
    if isinstance(config.get("matryoshka_dimensions"), list):
        matryoshka = tuple(int(d) for d in config["matryoshka_dimensions"])
    elif config.get("is_matryoshka"):
        matryoshka = ()
    return EmbeddingConfig(pooling, normalize, hidden_size, matryoshka)


def _json(path: Path) -> object:
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)
