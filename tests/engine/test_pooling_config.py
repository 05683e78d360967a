"""A checkpoint's embedding settings read as sentence-transformers publishes them (pooling
mode, Normalize module) and Matryoshka dimensions from config.json; a decoder without them
pools its last token, normalized."""

from __future__ import annotations

import json

import pytest

from engine.core.errors import InvalidParam
from engine.model.pooling_config import read_embedding_config


def _write(path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def test_a_bare_decoder_pools_its_last_token_normalized_and_cannot_truncate(tmp_path):
    _write(tmp_path / "config.json", {"hidden_size": 64})
    config = read_embedding_config(tmp_path, 64)
    assert (config.pooling, config.normalize, config.matryoshka) == ("last", True, None)
    config.check_dimensions(64)
    with pytest.raises(InvalidParam) as info:
        config.check_dimensions(32)
    assert info.value.param == "dimensions"


def test_sentence_transformers_modules_and_matryoshka_sizes_are_read(tmp_path):
    _write(tmp_path / "config.json", {"hidden_size": 64, "matryoshka_dimensions": [16, 32, 64]})
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    _write(tmp_path / "modules.json", modules)
    _write(tmp_path / "1_Pooling" / "config.json", {"pooling_mode_mean_tokens": True})
    config = read_embedding_config(tmp_path, 64)
    assert (config.pooling, config.normalize, config.matryoshka) == ("mean", False, (16, 32, 64))
    config.check_dimensions(16)
    with pytest.raises(InvalidParam, match="one of"):
        config.check_dimensions(20)
    modules.append(
        {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
    )
    _write(tmp_path / "modules.json", modules)
    _write(tmp_path / "config.json", {"hidden_size": 64, "is_matryoshka": True})
    config = read_embedding_config(tmp_path, 64)
    assert config.normalize and config.matryoshka == ()
    config.check_dimensions(20)
