"""Every checkpoint tests/gpu reads, written before its tests run in parallel workers (which
would otherwise write the same directories at once)."""

from engine.model.tiny_model import make_model
from engine.quant.checkpoint_writer import FORMATS
from tests.conftest import REPO, tiny_model_dir
from tests.engine.test_quantized_checkpoints import quant_model
from tests.lora_adapters import lora_adapters

for arch in ["llama", "qwen2", "qwen3", "mistral", "llama3", "mistral-window"]:
    tiny_model_dir(arch)
for size in ["tiny-hd64", "tiny-wide", "tiny-quant"]:
    make_model(REPO / "models" / size, size=size)
for fmt in FORMATS:
    quant_model(fmt)
lora_adapters(tiny_model_dir())
lora_adapters(str(REPO / "models" / "tiny-wide"))
print("prebuilt")
