"""Files of checkpoints and weight exports: checksummed, written atomically, read by byte range.

Two formats, both written one tensor (or chunk) at a time so that no file
needs its whole content in memory:

* zinf's checkpoint data files: raw tensor bytes, appended in order, with a
  CRC32 per ``BLOCK_BYTES`` block recorded in the rank's manifest (so a
  reader can verify any range it reads, and a verifier can name the block).
* safetensors (https://github.com/huggingface/safetensors): an 8-byte
  little-endian header length, a JSON header of names, dtypes, shapes and
  byte offsets, then the raw data; what ``transformers`` and
  ``safetensors.torch`` load.  The header is known before any data is
  written (shapes and dtypes are), so tensors stream in one by one.

Every file is written under a temporary name, fsynced and renamed into
place: a reader sees a whole file or none.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Iterable

import torch

BLOCK_BYTES = 4 << 20  # bytes per checksummed block of a checkpoint data file
READ_CHUNK_BYTES = 64 << 20  # largest single read of a range

DTYPE_NAMES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}
SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
DTYPES_BY_SAFETENSORS = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class ZinfCheckpointError(RuntimeError):
    """A checkpoint or weights file is incomplete, corrupt, or does not match the model."""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str, data: bytes) -> int:
    """Write ``data`` to ``path`` (temporary name, fsync, rename); returns its CRC32."""
    temporary = path + ".tmp"
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    return zlib.crc32(data)


def write_json_atomic(path: str, obj) -> int:
    return write_file_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def read_checked(path: str, crc: int | None, what: str) -> bytes:
    """The bytes of ``path``, checked against ``crc`` (None: unchecked)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise ZinfCheckpointError(f"{what} {path} is missing: the checkpoint is incomplete") from None
    if crc is not None and zlib.crc32(data) != crc:
        raise ZinfCheckpointError(f"{what} {path} is corrupt: its CRC32 is {zlib.crc32(data):08x}, the checkpoint "
                                  f"recorded {crc:08x}")
    return data


def read_json_checked(path: str, crc: int | None, what: str):
    data = read_checked(path, crc, what)
    try:
        return json.loads(data)
    except ValueError as err:
        raise ZinfCheckpointError(f"{what} {path} is not valid JSON ({err}): the checkpoint is corrupt") from None


class ChecksummedWriter:
    """Appends bytes to a data file, keeping a CRC32 per block; visible under its name at :meth:`commit`."""

    def __init__(self, path: str):
        self.path = path
        self._temporary = path + ".tmp"
        self._handle = open(self._temporary, "wb")
        self.size = 0
        self._crcs: list[int] = []
        self._block_crc = 0
        self._block_fill = 0

    def write(self, data) -> int:
        """Append ``data`` (bytes-like); returns the file offset it starts at."""
        offset = self.size
        view = memoryview(data).cast("B")
        self._handle.write(view)
        self.size += len(view)
        while len(view):
            take = min(len(view), BLOCK_BYTES - self._block_fill)
            self._block_crc = zlib.crc32(view[:take], self._block_crc)
            self._block_fill += take
            view = view[take:]
            if self._block_fill == BLOCK_BYTES:
                self._crcs.append(self._block_crc)
                self._block_crc, self._block_fill = 0, 0
        return offset

    def write_tensor(self, tensor: torch.Tensor) -> int:
        return self.write(tensor_bytes(tensor))

    def commit(self) -> dict:
        """Flush, fsync and rename into place; the description a manifest records."""
        if self._block_fill:
            self._crcs.append(self._block_crc)
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        os.replace(self._temporary, self.path)
        return {"file": os.path.basename(self.path), "bytes": self.size, "block_bytes": BLOCK_BYTES,
                "crc32": self._crcs}

    def abort(self) -> None:
        _discard(self._handle, self._temporary)


def _discard(handle, temporary: str) -> None:
    """Close and delete a file that was never renamed into place."""
    handle.close()
    try:
        os.unlink(temporary)
    except FileNotFoundError:
        pass


def verify_data_file(path: str, described: dict) -> None:
    """Check a data file's size and every block's CRC32 against its manifest; raise naming the file and block."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise ZinfCheckpointError(f"checkpoint data file {path} is missing") from None
    if size != described["bytes"]:
        raise ZinfCheckpointError(f"checkpoint data file {path} has {size:,} bytes, its manifest recorded "
                                  f"{described['bytes']:,}: it is truncated or was overwritten")
    block_bytes = described["block_bytes"]
    with open(path, "rb") as handle:
        for index, expected in enumerate(described["crc32"]):
            crc = zlib.crc32(handle.read(block_bytes))
            if crc != expected:
                first = index * block_bytes
                raise ZinfCheckpointError(
                    f"checkpoint data file {path} is corrupt: bytes {first:,}-{min(first + block_bytes, size):,} "
                    f"(block {index}) have CRC32 {crc:08x}, the manifest recorded {expected:08x}")


class RangeReader:
    """Reads byte ranges of files (``os.pread``), keeping each file open once."""

    def __init__(self):
        self._fds: dict[str, int] = {}

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise ZinfCheckpointError(f"{path} is missing") from None
        done = 0
        while done < len(out):
            count = os.preadv(fd, [out[done : done + READ_CHUNK_BYTES]], offset + done)
            if count == 0:
                raise ZinfCheckpointError(f"{path} ends at byte {offset + done:,}; {len(out) - done:,} more bytes were "
                                          f"expected there: the file is truncated")
            done += count

    def read_tensor(self, path: str, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        if numel:
            self.read_into(path, offset, memoryview(out.view(torch.uint8).numpy()).cast("B"))
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- safetensors -------------------------------------------------------------------


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, in the order of ``entries``."""

    def __init__(self, path: str, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = path
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._expected: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in entries:
            if dtype not in SAFETENSORS_DTYPES:
                raise ZinfCheckpointError(f"safetensors cannot hold {name} of dtype {dtype}")
            nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, nbytes))
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as the reference writer does
        self._temporary = path + ".tmp"
        self._handle = open(self._temporary, "wb")
        self._handle.write(struct.pack("<Q", len(encoded)) + encoded)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, nbytes = self._expected[self._next]
        data = tensor_bytes(tensor)
        if name != expected_name or len(data) != nbytes:
            raise ZinfCheckpointError(f"safetensors writer: got {name} ({len(data):,} bytes), expected "
                                      f"{expected_name} ({nbytes:,} bytes)")
        self._handle.write(data)
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            raise ZinfCheckpointError(f"safetensors writer: {len(self._expected) - self._next} tensor(s) never written")
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        os.replace(self._temporary, self.path)

    def abort(self) -> None:
        _discard(self._handle, self._temporary)


class SafetensorsTensor:
    """Where one tensor of a safetensors file lies: read any element range without reading the rest."""

    def __init__(self, path: str, name: str, dtype: torch.dtype, shape: tuple[int, ...], data_start: int):
        self.path, self.name, self.dtype, self.shape, self.data_start = path, name, dtype, shape, data_start

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def read(self, reader: RangeReader, first: int, stop: int) -> torch.Tensor:
        """Elements ``first:stop`` of the flattened tensor, in its file dtype."""
        return reader.read_tensor(self.path, self.data_start + first * self.dtype.itemsize, self.dtype, stop - first)


def open_safetensors(path: str) -> dict[str, SafetensorsTensor]:
    """The tensors of a safetensors file, or of a folder (one file, or a sharded set with an index json).

    Reads headers only.
    """
    if os.path.isdir(path):
        index = [name for name in os.listdir(path) if name.endswith(".safetensors.index.json")]
        if index:
            with open(os.path.join(path, index[0])) as handle:
                weight_map = json.load(handle).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
        if not files:
            raise ZinfCheckpointError(f"no .safetensors file (or *.safetensors.index.json) in {path}")
        tensors: dict[str, SafetensorsTensor] = {}
        for name in files:
            tensors.update(open_safetensors(os.path.join(path, name)))
        return tensors
    try:
        with open(path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise ZinfCheckpointError(f"{path} is not a safetensors file (shorter than its header length)")
            (header_bytes,) = struct.unpack("<Q", raw)
            size = os.fstat(handle.fileno()).st_size
            if header_bytes > size - 8:
                raise ZinfCheckpointError(f"{path} is not a safetensors file (header of {header_bytes:,} bytes in a "
                                          f"file of {size:,})")
            header = json.loads(handle.read(header_bytes))
    except FileNotFoundError:
        raise ZinfCheckpointError(f"weights file {path} does not exist") from None
    except ValueError as err:
        raise ZinfCheckpointError(f"{path}: unreadable safetensors header ({err})") from None
    data_start = 8 + header_bytes
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES_BY_SAFETENSORS.get(entry["dtype"])
        if dtype is None:
            raise ZinfCheckpointError(f"{path}: tensor {name} has dtype {entry['dtype']}, which zinf cannot read")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != int(torch.Size(shape).numel()) * dtype.itemsize or data_start + end > size:
            raise ZinfCheckpointError(f"{path}: tensor {name}'s byte range {begin}-{end} does not fit its shape "
                                      f"{shape} and dtype, or lies past the end of the file: the file is damaged")
        tensors[name] = SafetensorsTensor(path, name, dtype, shape, data_start + begin)
    return tensors
