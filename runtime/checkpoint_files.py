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

A folder being written to, or read from, is untrusted: a file is created
with ``O_EXCL | O_NOFOLLOW`` (whatever sits at its temporary name, a file a
killed writer left or a planted link, is unlinked first, never followed),
and a checkpoint's files are named by plain file names that
:func:`open_in_folder` confines to the folder and opens without following a
link.  Every defect of a file or of its description is a
:class:`ZinfCheckpointError` naming the file and the entry.
"""

from __future__ import annotations

import errno
import json
import os
import stat
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


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
# O_NONBLOCK: opening a FIFO planted under a file's name must not hang (a no-op for the regular files read).
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0)
_CREATE_ATTEMPTS = 3


def create_new(path: str):
    """A binary handle on a new, empty file at ``path``, never a file reached through a link.

    Whatever is at ``path`` (a file a killed writer left, or a link planted
    there) is unlinked first: a link is removed, its target never touched;
    the create is exclusive, so a link put back in between is refused.
    """
    for _ in range(_CREATE_ATTEMPTS):
        try:
            return os.fdopen(os.open(path, _CREATE_FLAGS, 0o666), "wb")
        except FileExistsError:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as err:
                raise ZinfCheckpointError(f"cannot write {path}: something that is not a file is in the way "
                                          f"({err}); remove it and try again") from None
    raise ZinfCheckpointError(f"cannot write {path}: it was created again each time zinf removed it; another "
                              f"process is writing into {os.path.dirname(path)}: write to a folder only this run "
                              f"uses")


def replace_into_place(temporary: str, path: str) -> None:
    """Rename ``temporary`` to ``path`` (a link at ``path`` is replaced, its target never written)."""
    try:
        os.replace(temporary, path)
    except OSError as err:
        raise ZinfCheckpointError(f"cannot put {path} in place ({err}); remove what is at {path} and try "
                                  f"again") from None


def write_file_atomic(path: str, data: bytes) -> int:
    """Write ``data`` to ``path`` (temporary name, fsync, rename); returns its CRC32."""
    temporary = path + ".tmp"
    with create_new(temporary) as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    replace_into_place(temporary, path)
    return zlib.crc32(data)


def write_json_atomic(path: str, obj) -> int:
    """Write ``obj`` as JSON to ``path`` atomically (see write_file_atomic); returns its CRC32."""
    return write_file_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def check_file_name(name, what: str, where: str) -> str:
    """``name`` if it is a plain file name (no path separator, not ``.``/``..``, not empty); else raise.

    ``where`` names the file and entry that recorded ``name``.
    """
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name or (
            os.altsep and os.altsep in name):
        raise ZinfCheckpointError(f"{where}: {what} is named {name!r}, which is not a plain file name inside the "
                                  f"checkpoint folder (zinf reads nothing outside it): the checkpoint is damaged or "
                                  f"was tampered with; load another one")
    return name


def open_regular(path: str, what: str) -> int:
    """A read-only descriptor of the regular file ``path``, not opened through a link at ``path``."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise ZinfCheckpointError(f"{what} {path} is missing: the checkpoint is incomplete") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ZinfCheckpointError(f"{what} {path} is a symbolic link; zinf reads a checkpoint's files only "
                                      f"as regular files inside its folder (a link may lead outside it): "
                                      f"replace the link by a copy of the file it points to") from None
        raise ZinfCheckpointError(f"{what} {path} cannot be opened ({err})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ZinfCheckpointError(f"{what} {path} is not a regular file (mode {stat.filemode(mode)}): the "
                                  f"checkpoint is damaged; load another one")
    return fd


def open_in_folder(folder: str, name, what: str, where: str) -> tuple[str, int]:
    """(path, read-only descriptor) of the file ``name`` directly in ``folder``: confined, never via a link."""
    path = os.path.join(folder, check_file_name(name, what, where))
    return path, open_regular(path, what)


def read_checked(folder: str, name: str, crc: int | None, what: str, where: str | None = None) -> bytes:
    """The bytes of ``folder/name``, checked against ``crc`` (None: unchecked)."""
    path, fd = open_in_folder(folder, name, what, where or folder)
    with open(fd, "rb") as handle:
        data = handle.read()
    if crc is not None and zlib.crc32(data) != crc:
        raise ZinfCheckpointError(f"{what} {path} is corrupt: its CRC32 is {zlib.crc32(data):08x}, the checkpoint "
                                  f"recorded {crc:08x}")
    return data


def read_json_checked(folder: str, name: str, crc: int | None, what: str, where: str | None = None):
    """Read the JSON file ``name`` in ``folder``, checked against ``crc`` (see read_checked)."""
    data = read_checked(folder, name, crc, what, where)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as err:
        raise ZinfCheckpointError(f"{what} {os.path.join(folder, name)} is not valid JSON ({err}): the checkpoint "
                                  f"is corrupt") from None


def is_count(value) -> bool:
    """A non-negative integer (not a bool): a size, offset or rank in an untrusted file's JSON."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_crc(value) -> bool:
    """A CRC32 value in an untrusted file's JSON."""
    return is_count(value) and value < 1 << 32


def check_data_description(described, where: str) -> None:
    """Check what a manifest says of its data file (``bytes``, ``block_bytes``, one ``crc32`` per block)."""
    damaged = "the checkpoint is damaged or was not written by zinf.save; load another one"
    if not isinstance(described, dict):
        raise ZinfCheckpointError(f"{where}: the data file's description is {type(described).__name__}, not an "
                                  f"object: {damaged}")
    for key in ("bytes", "block_bytes"):
        if not is_count(described.get(key)) or (key == "block_bytes" and described[key] == 0):
            raise ZinfCheckpointError(f"{where}: data.{key} is {described.get(key, 'missing')!r}, not a "
                                      f"{'positive' if key == 'block_bytes' else 'non-negative'} integer: {damaged}")
    crcs = described.get("crc32")
    if not isinstance(crcs, list) or not all(is_crc(crc) for crc in crcs):
        raise ZinfCheckpointError(f"{where}: data.crc32 is not a list of CRC32 values: {damaged}")
    blocks = -(-described["bytes"] // described["block_bytes"])
    if len(crcs) != blocks:
        raise ZinfCheckpointError(f"{where}: data.crc32 holds {len(crcs)} checksum(s) for the {described['bytes']:,} "
                                  f"bytes of data file {described.get('file', '?')} in blocks of "
                                  f"{described['block_bytes']:,}, which need {blocks}: part of the file would go "
                                  f"unchecked; {damaged}")


class ChecksummedWriter:
    """Appends bytes to a data file, keeping a CRC32 per block; visible under its name at :meth:`commit`."""

    def __init__(self, path: str):
        self.path = path
        self._temporary = path + ".tmp"
        self._handle = create_new(self._temporary)
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
        """Append ``tensor``'s bytes; returns the CRC32 of what it added."""
        return self.write(tensor_bytes(tensor))

    def commit(self) -> dict:
        """Flush, fsync and rename into place; the description a manifest records."""
        if self._block_fill:
            self._crcs.append(self._block_crc)
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        replace_into_place(self._temporary, self.path)
        return {"file": os.path.basename(self.path), "bytes": self.size, "block_bytes": BLOCK_BYTES,
                "crc32": self._crcs}

    def abort(self) -> None:
        """Close and remove the unfinished file."""
        _discard(self._handle, self._temporary)


def _discard(handle, temporary: str) -> None:
    """Close and delete a file that was never renamed into place."""
    handle.close()
    try:
        os.unlink(temporary)
    except FileNotFoundError:
        pass


def verify_data_file(path: str, described: dict, manifest: str | None = None) -> None:
    """Check a data file's size and every block's CRC32 against its manifest; raise naming the file and block.

    ``described`` must hold one CRC32 per block of the recorded size (none for
    an empty file): a list that leaves blocks unchecked is refused.
    ``manifest``: the manifest's path, for the errors.
    """
    check_data_description(described, manifest or f"checkpoint data file {path}")
    with open(open_regular(path, "checkpoint data file"), "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size != described["bytes"]:
            raise ZinfCheckpointError(f"checkpoint data file {path} has {size:,} bytes, its manifest "
                                      f"{manifest or ''}{' ' if manifest else ''}recorded {described['bytes']:,}: "
                                      f"it is truncated or was overwritten")
        block_bytes = described["block_bytes"]
        for index, expected in enumerate(described["crc32"]):
            crc = zlib.crc32(handle.read(block_bytes))
            if crc != expected:
                first = index * block_bytes
                raise ZinfCheckpointError(
                    f"checkpoint data file {path} is corrupt: bytes {first:,}-{min(first + block_bytes, size):,} "
                    f"(block {index}) have CRC32 {crc:08x}, the manifest recorded {expected:08x}")


class RangeReader:
    """Reads byte ranges of files (``os.pread``), keeping each file open once.

    ``follow_links=False`` (a checkpoint's data files): only regular files,
    never opened through a link.
    """

    def __init__(self, follow_links: bool = True):
        self._fds: dict[str, int] = {}
        self._follow_links = follow_links

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``path`` at ``offset``; raises if the file is shorter."""
        fd = self._fds.get(path)
        if fd is None:
            if not self._follow_links:
                fd = self._fds[path] = open_regular(path, "checkpoint data file")
            else:
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
        """``numel`` elements of ``dtype`` read from ``path`` at ``offset``, as a new CPU tensor."""
        out = torch.empty(numel, dtype=dtype)
        if numel:
            self.read_into(path, offset, memoryview(out.view(torch.uint8).numpy()).cast("B"))
        return out

    def close(self) -> None:
        """Close every file this reader opened."""
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
        self._handle = create_new(self._temporary)
        self._handle.write(struct.pack("<Q", len(encoded)) + encoded)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor; it must be the one the header announced, with as many bytes."""
        expected_name, nbytes = self._expected[self._next]
        data = tensor_bytes(tensor)
        if name != expected_name or len(data) != nbytes:
            raise ZinfCheckpointError(f"safetensors writer: got {name} ({len(data):,} bytes), expected "
                                      f"{expected_name} ({nbytes:,} bytes)")
        self._handle.write(data)
        self._next += 1

    def close(self) -> None:
        """Finish the file (every announced tensor written), sync it and move it into place."""
        if self._next != len(self._expected):
            raise ZinfCheckpointError(f"safetensors writer: {len(self._expected) - self._next} tensor(s) never written")
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        replace_into_place(self._temporary, self.path)

    def abort(self) -> None:
        """Close and remove the unfinished file."""
        _discard(self._handle, self._temporary)


class SafetensorsTensor:
    """Where one tensor of a safetensors file lies: read any element range without reading the rest."""

    def __init__(self, path: str, name: str, dtype: torch.dtype, shape: tuple[int, ...], data_start: int):
        self.path, self.name, self.dtype, self.shape, self.data_start = path, name, dtype, shape, data_start

    @property
    def numel(self) -> int:
        """Elements in the tensor."""
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
            index_path = os.path.join(path, index[0])
            try:
                with open(index_path) as handle:
                    weight_map = json.load(handle).get("weight_map", {})
            except (ValueError, RecursionError, AttributeError) as err:
                raise ZinfCheckpointError(f"{index_path} is not a safetensors index ({err})") from None
            if not isinstance(weight_map, dict):
                raise ZinfCheckpointError(f"{index_path}: weight_map is not an object: the index is damaged")
            for file in weight_map.values():
                # Links are fine (a Hugging Face cache links its snapshots to blobs); names out of the folder not.
                if not isinstance(file, str) or os.path.isabs(file) or \
                        os.path.normpath(file).split(os.sep)[0] in ("..", "", "."):
                    raise ZinfCheckpointError(f"{index_path}: weight_map names the file {file!r}, which is not a "
                                              f"file inside {path}: the index is damaged or was tampered with")
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
    except (ValueError, RecursionError) as err:
        raise ZinfCheckpointError(f"{path}: unreadable safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise ZinfCheckpointError(f"{path}: the safetensors header is not an object: the file is damaged")
    data_start = 8 + header_bytes
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, (begin, end), shape = entry["dtype"], entry["data_offsets"], tuple(entry["shape"])
            dtype = DTYPES_BY_SAFETENSORS.get(dtype_name)
            if not all(is_count(n) for n in (begin, end, *shape)):
                raise TypeError("offsets and shape must be non-negative integers")
        except (KeyError, TypeError, ValueError) as err:
            raise ZinfCheckpointError(f"{path}: the header entry of tensor {name} is malformed ({err!r}): the file "
                                      f"is damaged") from None
        if dtype is None:
            raise ZinfCheckpointError(f"{path}: tensor {name} has dtype {dtype_name}, which zinf cannot read")
        numel = 1
        for n in shape:
            numel *= n
        if end - begin != numel * dtype.itemsize or data_start + end > size:
            raise ZinfCheckpointError(f"{path}: tensor {name}'s byte range {begin}-{end} does not fit its shape "
                                      f"{shape} and dtype, or lies past the end of the file: the file is damaged")
        tensors[name] = SafetensorsTensor(path, name, dtype, shape, data_start + begin)
    return tensors
