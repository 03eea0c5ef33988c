"""A pipeline's checkpoint: one folder for the whole model, a stage folder per stage, and its layout.

A model cut into pipeline stages (zinf_compiler/pipeline_parallel.py) is one zinf model per stage, each on its
own ranks.  Its checkpoint is one folder::

    step-000100/
        stage-000/   a checkpoint of stage 0's model, written and read by that stage's ranks alone
        stage-001/   (the format of any checkpoint: files per rank of the stage, meta.json, COMMITTED)
        extra.pt     ``extra`` (global rank 0)
        meta.json    the layout: pp, and each stage's tp x dp and ranks; saved_at; extra's CRC32
        COMMITTED    the CRC32 of meta.json, written last

Every rank takes part in the whole folder's agreement (an all-gather over every rank), so the folder is
published, atomically, only once every stage's folder is complete, and a load changes no stage until every
stage's folder has been checked.  Inside a stage folder the stage's ranks number the files, so a stage reloads at
another dp (or tp, where its checkpoints allow) like any model; the number of stages must be the saved one (a
stage folder holds that stage's parameters, under the stage module's names).

This module knows the layout: which stage a model is, the ranks of each stage (a process group made once per
layout), and the top folder's meta.json.  saving.py and loading.py use it.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from ..runtime.checkpoint_files import ZinfCheckpointError
from ..runtime.model_group import ModelView
from .format import FORMAT
from .model_state import tp_mesh_of
from .reader import read_committed_meta
from .validation import bad, is_number

# (The process groups of each layout met, made once: every rank must make them together, in the same order.)
_STAGE_GROUPS: dict[tuple, dict[int, object]] = {}


def stage_folder(path: str, index: int) -> str:
    """The folder of stage ``index`` inside a pipeline's checkpoint folder ``path``."""
    return os.path.join(path, f"stage-{index:03d}")


def model_of(model):
    """The stage's model, also when given torch's stage object (``ZinfPipelineStage``, whose ``submod`` it is)."""
    return getattr(model, "submod", model) if not isinstance(model, torch.nn.Module) else model


def stage_of(view: ModelView, model: torch.nn.Module) -> tuple[int, int] | None:
    """``(stage index, number of stages)`` of a pipeline stage's model (None: not a stage)."""
    stages = {group.stage for group in view.groups if group.stage is not None}
    if len(stages) > 1:
        raise ZinfCheckpointError(f"the model's parameters belong to several pipeline stages {sorted(stages)}; "
                                  f"save and load each stage's model")
    return next(iter(stages), None)


class StageLayout:
    """Where every rank's stage lies: ``stages[rank]``, the stage of each global rank, and ``comm``, this stage's
    ranks' Comm (the stage folder's), and ``describe`` for messages: ``pp 2 x (tp 2 x dp 2)``."""

    def __init__(self, view: ModelView, model: torch.nn.Module, stage: tuple[int, int], what: str):
        world = view.comm
        tp_mesh = tp_mesh_of(model)
        tp = tp_mesh.size() if tp_mesh is not None else 1
        index, count = stage
        gathered = world.all_gather_object((index, count, tp), f"all_gather of the pipeline's stages ({what})")
        problems = []
        counts = {entry[1] for entry in gathered}
        if len(counts) > 1:
            problems.append(f"the ranks' stages say the pipeline has {sorted(counts)} stages")
        present = sorted({entry[0] for entry in gathered})
        if present != list(range(count)):
            problems.append(f"the ranks passed stages {present} of {count} (each rank must pass its one stage's "
                            f"model; several stages per rank, as interleaved schedules have, are not supported "
                            f"by zinf.{what} yet)")
        if problems:
            raise ZinfCheckpointError(f"zinf.{what} of a pipeline refused: " + "; ".join(problems))
        self.stages = [entry[0] for entry in gathered]
        self.count, self.index = count, index
        self.ranks = [[rank for rank, at in enumerate(self.stages) if at == stage] for stage in range(count)]
        self.tps = [gathered[ranks[0]][2] for ranks in self.ranks]
        key = tuple(self.stages)
        if key not in _STAGE_GROUPS:
            # new_group is collective over every rank: each group made by all, in stage order.
            _STAGE_GROUPS[key] = {stage: dist.new_group(ranks) for stage, ranks in enumerate(self.ranks)}
        self.comm = world.subgroup(_STAGE_GROUPS[key][index])

    def describe(self) -> str:
        """The layout in words (stages, and each one's ranks, tp and dp), for messages."""
        return describe(self.meta())

    def meta(self) -> dict:
        """What the checkpoint's meta.json records of the layout: stages, their ranks, tp and dp sizes."""
        return {"stages": self.count, "ranks": self.ranks,
                "tp": self.tps, "dp": [len(ranks) // tp for ranks, tp in zip(self.ranks, self.tps)]}


def describe(layout: dict) -> str:
    """``pp 2 x (tp 2 x dp 2)``; stages of different shapes are listed one by one."""
    shapes = sorted({(tp, dp) for tp, dp in zip(layout["tp"], layout["dp"])})
    if len(shapes) == 1:
        (tp, dp), = shapes
        return f"pp {layout['stages']} x (tp {tp} x dp {dp})"
    return f"pp {layout['stages']} with stages " + ", ".join(f"tp {tp} x dp {dp}" for tp, dp in
                                                             zip(layout["tp"], layout["dp"]))


def top_meta(layout: StageLayout, world_size: int) -> dict:
    """The whole folder's meta.json (``extra`` is added by the writer when there is one)."""
    return {"format": FORMAT, "pipeline": layout.meta(), "world_size": world_size, "saved_at": time.time()}


def is_pipelined(path: str) -> bool:
    """Whether the committed checkpoint folder ``path`` is a pipeline's (its meta.json has ``pipeline``)."""
    try:
        return "pipeline" in read_top_meta(path)
    except ZinfCheckpointError:
        return False


def read_top_meta(path: str) -> dict:
    """The pipeline folder's meta.json, checked against COMMITTED's CRC32 and for the fields a load reads."""
    meta = read_committed_meta(path)
    where = os.path.join(path, "meta.json")
    if not isinstance(meta, dict):
        raise bad(where, "(top level)", "is not an object")
    layout = meta.get("pipeline")
    if layout is None:
        return meta
    if not isinstance(layout, dict):
        raise bad(where, "pipeline", "is not an object")
    count = layout.get("stages")
    if not (isinstance(count, int) and count >= 1):
        raise bad(where, "pipeline.stages", "is not a positive integer")
    for field in ("tp", "dp"):
        values = layout.get(field)
        if not (isinstance(values, list) and len(values) == count
                and all(isinstance(v, int) and v >= 1 for v in values)):
            raise bad(where, f"pipeline.{field}", f"is not {count} positive integers")
    if not is_number(meta.get("saved_at")):
        raise bad(where, "saved_at", "is not a number")
    return meta
