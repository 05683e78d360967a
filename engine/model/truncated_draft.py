"""A draft model cut from its target: the first N decoder layers, with the target's
embeddings, final norm and LM head, as an ordinary checkpoint directory (the tokenizer
copied beside it). It shares the target's tokenizer by construction and agrees with it more
than an unrelated small model would: a draft for `speculative.method: draft_model` where no
smaller sibling checkpoint exists, and the test and benchmark draft.

    python -m engine.model.truncated_draft --model DIR --layers 2 --out DIR
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def make_truncated_draft(model: str | Path, num_layers: int, out: str | Path) -> Path:
    """Write the draft (skipped if `out` already holds a checkpoint) and return its path."""
    model, out = Path(model), Path(out)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    config = json.loads((model / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"layers: {num_layers} not in [1, {config['num_hidden_layers']}]")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for shard in sorted(model.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                layer = _LAYER.match(name)
                if layer is None or int(layer.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    if config.get("layer_types"):  # gpt-oss's windowed and full layers, one kind each
        config["layer_types"] = config["layer_types"][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = (".safetensors", ".index.json")
    for extra in model.iterdir():  # the tokenizer, generation config, chat template
        if extra.is_file() and not extra.name.endswith(weights) and extra.name != "config.json":
            shutil.copy(extra, out / extra.name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    print(f"wrote {make_truncated_draft(args.model, args.layers, args.out)}")


if __name__ == "__main__":
    main()
