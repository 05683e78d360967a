"""Read safetensors checkpoints tensor by tensor, straight into the memory that keeps them.

We parse the format ourselves (an 8-byte header length, a JSON header of names, dtypes,
shapes and byte offsets, then the data) and read each tensor with plain file reads: into
its destination when that is host memory of the same dtype, else through one reused staging
buffer. Memory-mapping the file instead would count every page read in the process's
resident set until the map closes, doubling peak host memory while a model loads.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def read_index(files: list[Path]) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint files, by name, from their headers alone."""
    entries: dict[str, TensorEntry] = {}
    for file in files:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"model: tensor {name} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            entries[name] = TensorEntry(
                name,
                file,
                _DTYPES[info["dtype"]],
                tuple(info["shape"]),
                8 + header_len + begin,
                end - begin,
            )
    return entries


class CheckpointReader:
    """Copies checkpoint tensors into destination tensors of any device and dtype, keeping
    one open file and, where needed, one staging buffer (pinned when the target is a GPU)."""

    def __init__(self, entries: dict[str, TensorEntry], device: torch.device) -> None:
        self.entries = entries
        self._pin = device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.uint8, pin_memory=self._pin)
        self._file = None
        self._path: Path | None = None

    def copy_into(self, name: str, dest: torch.Tensor) -> None:
        entry = self.entries[name]
        if tuple(dest.shape) != entry.shape:
            raise ValueError(
                f"model: weight {name} has shape {entry.shape}, expected {tuple(dest.shape)}"
            )
        direct = dest.device.type == "cpu" and dest.dtype == entry.dtype and dest.is_contiguous()
        if direct:
            self._read(entry, dest.reshape(-1).view(torch.uint8))
            return
        if self._staging.numel() < entry.nbytes:
            self._staging = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=self._pin)
        raw = self._staging[: entry.nbytes]
        self._read(entry, raw)
        count = math.prod(entry.shape)
        dest.copy_(raw.view(entry.dtype)[:count].view(entry.shape))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _read(self, entry: TensorEntry, into: torch.Tensor) -> None:
        if self._path != entry.file:
            self.close()
            self._file = open(entry.file, "rb")  # noqa: SIM115 - kept open across tensors
            self._path = entry.file
        f = self._file
        f.seek(entry.offset)
        view = memoryview(into.numpy()).cast("B")
        done = 0
        while done < entry.nbytes:
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"model: {entry.file} ends inside tensor {entry.name}")
            done += n
