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

from engine.model.sharding import SliceOf

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BOOL": torch.bool,
}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


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
    """Copies checkpoint tensors, or one rank's slice of them (engine/model/sharding.py), into
    destination tensors of any device and dtype, keeping one open file and, where needed, one
    staging buffer (pinned when the target is a GPU). `bytes_read` counts what it read."""

    def __init__(self, entries: dict[str, TensorEntry], device: torch.device) -> None:
        self.entries = entries
        self._pin = device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.uint8, pin_memory=self._pin)
        self._file = None
        self._path: Path | None = None
        self.bytes_read = 0

    def read(self, name: str, piece: SliceOf | None = None) -> torch.Tensor:
        """A new host tensor of checkpoint tensor `name` (or of its slice `piece`, which must
        lie inside it), in the checkpoint's dtype."""
        entry = self.entries[name]
        shape = list(entry.shape)
        if piece is not None:
            shape[piece.dim] = piece.length
        out = torch.empty(shape, dtype=entry.dtype)
        ranges, _ = self._plan(entry, out, piece)
        self._read(entry, ranges, out.reshape(-1).view(torch.uint8))
        return out

    def copy_into(self, name: str, dest: torch.Tensor, piece: SliceOf | None = None) -> None:
        entry = self.entries[name]
        expected = list(dest.shape)
        if piece is not None:
            expected[piece.dim] = piece.full
        if entry.shape != tuple(expected):
            raise ValueError(
                f"model: weight {name} has shape {entry.shape}, expected {tuple(expected)}"
            )
        if entry.dtype in _FP8 and dest.dtype not in _FP8:
            # An FP8 tensor is read where a float one belongs: without its scale it is wrong.
            raise ValueError(
                f"model: weight {name} is {entry.dtype}, but the engine holds it unquantized "
                "(is it missing from quantization_config's list of modules not converted?)"
            )
        ranges, part = self._plan(entry, dest, piece)
        total = sum(n for _, n in ranges)
        direct = part.device.type == "cpu" and part.dtype == entry.dtype and part.is_contiguous()
        if direct:
            self._read(entry, ranges, part.reshape(-1).view(torch.uint8))
            return
        if self._staging.numel() < total:
            self._staging = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin)
        raw = self._staging[:total]
        self._read(entry, ranges, raw)
        part.copy_(raw.view(entry.dtype).view(part.shape))

    @staticmethod
    def _plan(
        entry: TensorEntry, dest: torch.Tensor, piece: SliceOf | None
    ) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """The byte ranges (from the tensor's start) to read, in order, and the part of `dest`
        they fill (zeroing what the checkpoint does not have)."""
        if piece is None:
            return [(0, entry.nbytes)], dest
        if piece.dim == 0:
            row_bytes = entry.nbytes // entry.shape[0]
            count = max(min(piece.length, piece.full - piece.start), 0)
            dest[count:].zero_()
            return [(piece.start * row_bytes, count * row_bytes)], dest[:count]
        elem = entry.nbytes // math.prod(entry.shape)
        cols, width = entry.shape[1], piece.length * elem
        starts = ((r * cols + piece.start) * elem for r in range(entry.shape[0]))
        return [(start, width) for start in starts], dest

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _read(self, entry: TensorEntry, ranges: list[tuple[int, int]], into: torch.Tensor) -> None:
        if self._path != entry.file:
            self.close()
            self._file = open(entry.file, "rb")  # noqa: SIM115 - kept open across tensors
            self._path = entry.file
        f = self._file
        view = memoryview(into.numpy()).cast("B")
        done = 0
        for offset, nbytes in ranges:
            f.seek(entry.offset + offset)
            end = done + nbytes
            while done < end:
                n = f.readinto(view[done:end])
                if not n:
                    raise ValueError(f"model: {entry.file} ends inside tensor {entry.name}")
                done += n
        self.bytes_read += done
