"""A committed checkpoint folder, read: checked, indexed by (name, kind), and read by element range."""

from __future__ import annotations

import math
import os

import torch

from .. import tensor_parallel
from ..runtime.checkpoint_files import (DTYPE_NAMES, DTYPES_BY_NAME, RangeReader, ZinfCheckpointError, read_checked,
                                        read_json_checked, verify_data_file)
from ..runtime.store import ParamRecord
from .format import COMMIT_MARKER
from .validation import bad, check_manifest, check_meta


class Checkpoint:
    """A committed checkpoint folder, checked and indexed by (name, kind) -> pieces.

    The folder is untrusted input.  Every file it names (manifests, data
    files, ``extra``) must be a plain file name inside it and is opened
    without following a link; every field a load uses is checked before any
    data file is read: types, one manifest per saved rank, offsets and
    counts inside the data file, a tensor's pieces disjoint and inside it,
    values and buffers covered whole, RNG states restorable.  A defect is a
    ``ZinfCheckpointError`` naming the file and the entry.
    """

    def __init__(self, path: str, verify: bool = True):
        self.path = path
        meta_path = os.path.join(path, "meta.json")
        self.meta = read_committed_meta(path)
        check_meta(self.meta, meta_path)
        by_rank: dict[int, tuple[str, dict]] = {}
        for name, crc in sorted(self.meta["manifests"].items()):
            manifest_path = os.path.join(path, name)
            manifest = read_json_checked(path, name, crc, "checkpoint manifest", f"{meta_path}: manifests")
            rank = check_manifest(manifest, manifest_path, self.meta)
            if rank in by_rank:
                raise bad(manifest_path, "rank", f"is {rank}, as in {by_rank[rank][0]}")
            by_rank[rank] = (manifest_path, manifest)
        # check_meta: as many manifests as ranks; check_manifest: ranks below world_size, here distinct.
        ordered = [by_rank[rank] for rank in range(self.meta["world_size"])]
        self.manifests = [manifest for _, manifest in ordered]
        self.manifest_paths = [manifest_path for manifest_path, _ in ordered]
        self.data_paths = [os.path.join(path, manifest["data"]["file"]) for manifest in self.manifests]
        self.pieces: dict[tuple[str, str], list] = {}
        self.dtypes: dict[tuple[str, str], torch.dtype] = {}
        self.scalars: dict[str, dict] = {}
        for (manifest_path, manifest), data_path in zip(ordered, self.data_paths):
            for index, entry in enumerate(manifest["entries"]):
                key = (entry["name"], entry["kind"])
                dtype = DTYPES_BY_NAME[entry["dtype"]]
                if self.dtypes.setdefault(key, dtype) != dtype:
                    raise bad(manifest_path, f"entries[{index}].dtype", f"is {entry['dtype']}, another manifest "
                               f"holds {entry['name']} ({entry['kind']}) as {DTYPE_NAMES[self.dtypes[key]]}")
                self.pieces.setdefault(key, []).extend(
                    (first, stop, data_path, offset, dtype) for first, stop, offset in entry["pieces"])
            for name, values in manifest["scalars"].items():
                self.scalars.setdefault(name, values)
        for pieces in self.pieces.values():
            pieces.sort()
        self._check_pieces()
        self.reader = RangeReader(follow_links=False)

    def _check_pieces(self) -> None:
        """A tensor's pieces must not overlap; a value or buffer must be covered whole."""
        sizes = {**{(name, "value"): info["shape"] for name, info in self.meta["params"].items()},
                 **{(name, "buffer"): info["shape"] for name, info in self.meta["buffers"].items()}}
        for (name, kind), shape in sizes.items():
            numel = math.prod(shape)
            covered = sum(stop - first for first, stop, *_ in self.pieces.get((name, kind), []))
            if covered != numel:
                raise ZinfCheckpointError(f"{self.path}: the manifests hold {covered:,} of the {numel:,} elements of "
                                          f"{name} ({kind}): the checkpoint is incomplete or damaged; load another "
                                          f"one")
        for (name, kind), pieces in self.pieces.items():
            for (_, stop, *_), (first, *_) in zip(pieces, pieces[1:]):
                if first < stop:
                    raise ZinfCheckpointError(f"{self.path}: two pieces of {name} ({kind}) both hold element "
                                              f"{first:,}: the checkpoint is damaged; load another one")

    def verify(self, comm) -> None:
        """Check every data file's blocks, the work split over ranks; all ranks raise the same error."""
        errors = []
        for index in range(len(self.manifests)):
            if index % comm.world_size != comm.rank:
                continue
            try:
                self.verify_data(index)
            except ZinfCheckpointError as err:
                errors.append(str(err))
        gathered = comm.all_gather_object(errors, "all_gather of checkpoint verification (load)")
        found = [message for messages in gathered for message in messages]
        if found:
            raise ZinfCheckpointError(f"load from {self.path} refused, nothing was changed: " + "; ".join(found))

    def verify_data(self, index: int) -> None:
        """Check the size and every block's CRC32 of the data file of rank ``index``."""
        verify_data_file(self.data_paths[index], self.manifests[index]["data"], self.manifest_paths[index])

    def has(self, name: str, kind: str) -> bool:
        """Whether the checkpoint holds any piece of ``name``'s ``kind`` (``"value"``, ``"buffer"``, ``"state.*"``)."""
        return (name, kind) in self.pieces

    def dtype(self, name: str, kind: str) -> torch.dtype:
        """The dtype the checkpoint holds ``name`` (``kind``) in."""
        return self.dtypes[(name, kind)]

    def read_ranges(self, name: str, kind: str, ranges, local_numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A local tensor of ``local_numel`` elements: each (first, stop, local_start) range filled from the pieces."""
        out = torch.zeros(local_numel, dtype=dtype)
        pieces = self.pieces.get((name, kind), [])
        for first, stop, local_start in ranges:
            covered = 0
            for piece_first, piece_stop, data_path, offset, piece_dtype in pieces:
                low, high = max(first, piece_first), min(stop, piece_stop)
                if low >= high:
                    continue
                values = self.reader.read_tensor(data_path, offset + (low - piece_first) * piece_dtype.itemsize,
                                                 piece_dtype, high - low)
                out[local_start + low - first : local_start + high - first].copy_(values)
                covered += high - low
            if covered != stop - first:
                raise ZinfCheckpointError(f"{self.path}: the checkpoint holds {covered:,} of elements {first:,}-"
                                          f"{stop:,} of {name} ({kind}); it is incomplete or was written by "
                                          f"another model")
        return out

    def read_full(self, name: str, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The whole flat tensor ``name`` (``kind``) of ``numel`` elements, whatever world size wrote it."""
        return self.read_ranges(name, kind, [(0, numel, 0)], numel, dtype)

    def read_local(self, record: ParamRecord, param: torch.Tensor, name: str, kind: str,
                   dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of ``name`` (``kind``) in this run's layout: the ranges ``record`` owns (of
        ``param``'s TP-local tensor, for a tensor-parallel parameter: ranges of the whole tensor then)."""
        return self.read_ranges(name, kind, tensor_parallel.global_ranges(param, record.owned_ranges()),
                                record.local_numel, dtype)

    def close(self) -> None:
        """Close the data files (the reader's open handles)."""
        self.reader.close()


def read_committed_meta(path: str):
    """The meta.json of the committed folder ``path``, checked against the CRC32 its commit marker holds."""
    marker = os.path.join(path, COMMIT_MARKER)
    if not os.path.lexists(marker):
        raise ZinfCheckpointError(not_committed(path))
    try:
        meta_crc = int(read_checked(path, COMMIT_MARKER, None, "commit marker").decode().strip())
    except ValueError:
        raise ZinfCheckpointError(f"commit marker {marker} is damaged: the checkpoint is corrupt") from None
    return read_json_checked(path, "meta.json", meta_crc, "checkpoint metadata")


def not_committed(path: str) -> str:
    """Why there is no complete checkpoint at ``path``, and what to load instead (an error's message)."""
    if os.path.isdir(path + ".old") and os.path.exists(os.path.join(path + ".old", COMMIT_MARKER)):
        return (f"no checkpoint at {path}: a save that was replacing it was interrupted; the previous complete "
                f"checkpoint is at {path}.old (load that, or rename it)")
    if os.path.isdir(path + ".partial"):
        return (f"no complete checkpoint at {path}: the save was interrupted ({path}.partial has no commit "
                f"marker); load an earlier checkpoint (zinf.latest(folder) finds the newest complete one)")
    if os.path.isdir(path):
        return (f"{path} is not a complete zinf checkpoint: it has no {COMMIT_MARKER} marker (a save interrupted "
                f"before its commit, or not a zinf checkpoint)")
    return f"no checkpoint at {path}"
