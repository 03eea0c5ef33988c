"""Checkpoints: save every rank's shards, load them back at any world size, export consolidated weights.

    zinf.save("ckpt/step-1000", model, opt, extra={"data": loader_state})
    extra = zinf.load("ckpt/step-1000", model, opt)        # any world size, any offload setting
    zinf.export("gpt-final", model)                       # model.safetensors (+ config.json for transformers)

A checkpoint is a folder:

* ``rank-00000.bin``: raw bytes of what rank 0 holds (fp32 master slices,
  optimizer moments; full buffers and unsharded parameters on rank 0 only),
  streamed from the tier each rests on (a swap key or a 64 MiB chunk at a
  time: an NVMe-resident state never passes through memory whole).
* ``rank-00000.json``: where each piece lies: for every parameter and kind
  (``value``, ``state.exp_avg``, ...), the element ranges of the *flat
  parameter* it holds and their file offsets, a CRC32 per 4 MiB of the data
  file, scalar optimizer state (``step``) and the rank's RNG states.
* ``meta.json`` (rank 0): names, shapes and dtypes, the layout options each
  parameter was saved with, the optimizer's class and param groups, the fp16
  loss scale, and the CRC32 of every manifest.
* ``COMMITTED`` (rank 0, last): the CRC32 of ``meta.json``.

Element ranges of the flat parameter, not shards, are what make a checkpoint
independent of the layout: a load at another world size, partition, tile
plan or tier reads, for each range its shard needs, the pieces that cover it.
A model sharded over a ``mesh`` option's 2-D mesh (HSDP) is saved by its
first replica alone, one file per shard rank (the other replicas hold the
same shards); ``meta.json`` says so (``mesh``).  It loads like any other
checkpoint, into any mesh or none.

Atomicity: everything is written into ``<path>.partial``, each file under a
temporary name, fsynced and renamed; the ranks then agree (an all-gather of
outcomes) and rank 0 writes ``COMMITTED`` and renames the folder to
``<path>`` (a checkpoint already there is replaced).  A save killed at any
point leaves either the previous checkpoint or the new one, never a mix;
``load`` refuses a folder without ``COMMITTED``.  All ranks must see the same
filesystem at ``path`` (as with ``torch.distributed.checkpoint``'s
FileSystemWriter).

Why not ``torch.distributed.checkpoint`` (DCP) as the format: DCP's save and
load take a state dict whose values are tensors in memory (or DTensors whose
local shards are); a state resting in swap files would first have to be read
whole into RAM, which is what a model larger than RAM cannot do.  zinf's own
format streams instead; :func:`export` writes the consolidated safetensors
that the rest of the ecosystem (``transformers``, ``safetensors``, plain
``torch``) reads.

The package, by job: :mod:`.format` (how the files encode tensors and RNG
states), :mod:`.model_state` (what a model and its optimizer hold),
:mod:`.saving` (``save`` and the atomic publish), :mod:`.reader` (a committed
folder, checked and read by range), :mod:`.validation` (checks of its JSON,
untrusted input), :mod:`.loading` (``load``, ``latest``), :mod:`.exporting`
(``export``, ``to_safetensors``), :mod:`.pipeline_layout` (a pipeline's stages in one folder, a
stage folder each).  The store is reached through the model
(``api.store_of``); the optimizer's state through its ``save_state`` /
``load_state``: no module here reads a swap file's key.
"""

from __future__ import annotations

from ..runtime.checkpoint_files import ZinfCheckpointError
from .exporting import export, to_safetensors
from .format import COMMIT_MARKER, FORMAT
from .loading import latest, load
from .reader import Checkpoint
from .saving import save

__all__ = ["save", "load", "latest", "export", "to_safetensors", "ZinfCheckpointError", "Checkpoint", "COMMIT_MARKER",
           "FORMAT"]
