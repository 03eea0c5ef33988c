"""A checkpoint folder (and an export folder) is untrusted input.

Writes never go through a link planted in the folder; reads never leave the
checkpoint folder; counts, offsets and sizes are checked; every defect is a
``ZinfCheckpointError`` naming the file or entry, raised before the model,
the optimizer or the RNG change.
"""

import builtins
import contextlib
import copy
import json
import os
import random
import re
import shutil
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from zinf_compiler.runtime.checkpoint_files import BLOCK_BYTES, verify_data_file

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
BATCHES = synthetic_batches(CFG, 2, 2)
DATA, MANIFEST = "rank-00000.bin", "rank-00000.json"


class Run:
    """A tiny compiled GPT with a zinf AdamW, trained for a step (so the optimizer has moments)."""

    def __init__(self, options: dict | None = None):
        torch._dynamo.reset()
        torch.manual_seed(0)
        self.model = GPT(CFG)
        self.compiled = torch.compile(self.model, backend="zinf",
                                      options={"lower": "eager", "stage": 3, **(options or {})})
        self.opt = zinf.optim.AdamW(self.model.parameters(), lr=1e-2)
        idx, targets = BATCHES[0]
        self.compiled(idx, targets).backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict:
        """Everything a load may change: parameters, buffers, optimizer state, RNG."""
        model = {k: v.clone() for k, v in zinf.full_state_dict(self.compiled).items()}
        opt = self.opt.state_dict()
        moments = {(index, kind): value.clone() if isinstance(value, torch.Tensor) else value
                   for index, state in opt["state"].items() for kind, value in state.items()}
        groups = [{k: v for k, v in group.items() if k != "params"} for group in opt["param_groups"]]
        return {"model": model, "moments": moments, "groups": groups, "rng": torch.get_rng_state().clone(),
                "python_rng": random.getstate()}


def _same(a: dict, b: dict) -> bool:
    def equal(x, y):
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape):
                return False
            # NaN equals NaN, as in the scalar case below: bytes read as another dtype may be NaN.
            return bool((x.isnan() & y.isnan() | (x == y)).all()) if x.is_floating_point() else torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(equal(p, q) for p, q in zip(x, y))
        return x == y or (x != x and y != y)
    return equal(a, b)


def _differing(a: dict, b: dict) -> list[str]:
    """The parts of two states that differ, parameters and moments by key (a failure that says where)."""
    parts = []
    for part, x in a.items():
        y = b[part]
        if isinstance(x, dict) and isinstance(y, dict):
            parts += [f"{part}[{key!r}]" for key in x.keys() | y.keys()
                      if key not in x or key not in y or not _same(x[key], y[key])]
        elif not _same(x, y):
            parts.append(part)
    return sorted(parts)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A good checkpoint (with an ``extra``) and the run that saved it."""
    root = tmp_path_factory.mktemp("untrusted")
    run = Run()
    zinf.save(root / "good", run.compiled, run.opt, extra={"step": 1})
    return root / "good", run


def _copy(good, where) -> str:
    shutil.copytree(good, where)
    return where


def _read_json(path):
    with open(path) as handle:
        return json.load(handle)


def _write_json(path, obj) -> int:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    os.unlink(path)
    with open(path, "wb") as handle:
        handle.write(data)
    return zlib.crc32(data)


def _reseal(folder, manifests: dict | None = None, meta: dict | None = None) -> None:
    """Rewrite edited manifests and meta.json with matching CRCs, as an attacker (or a buggy tool) would."""
    meta = meta if meta is not None else _read_json(folder / "meta.json")
    for name, manifest in (manifests or {}).items():
        crc = _write_json(folder / name, manifest)
        if isinstance(meta, dict) and isinstance(meta.get("manifests"), dict) and name in meta["manifests"]:
            meta["manifests"][name] = crc
    meta_crc = _write_json(folder / "meta.json", meta)
    os.unlink(folder / "COMMITTED")
    (folder / "COMMITTED").write_bytes(f"{meta_crc}\n".encode())


@contextlib.contextmanager
def _opens_recorded():
    """The file behind every successful open (builtins.open and os.open) while inside, links resolved."""
    opened = []
    real_open, real_os_open = builtins.open, os.open

    def record(fd: int) -> None:
        with contextlib.suppress(OSError):
            opened.append(os.readlink(f"/proc/self/fd/{fd}"))

    def recording_open(file, *args, **kwargs):
        handle = real_open(file, *args, **kwargs)
        with contextlib.suppress(Exception):
            record(handle.fileno())
        return handle

    def recording_os_open(path, *args, **kwargs):
        fd = real_os_open(path, *args, **kwargs)
        record(fd)
        return fd

    builtins.open, os.open = recording_open, recording_os_open
    try:
        yield opened
    finally:
        builtins.open, os.open = real_open, real_os_open


def _refused(run: Run, folder, match: str, outside=None) -> None:
    """Loading ``folder`` raises ZinfCheckpointError matching ``match``; nothing changed, nothing outside read."""
    before = run.state()
    with _opens_recorded() as opened, pytest.raises(zinf.ZinfCheckpointError, match=match):
        zinf.load(folder, run.compiled, run.opt)
    if outside is not None:
        assert not [path for path in opened if path.startswith(os.path.realpath(outside))], opened
    assert _same(run.state(), before)


# --- (a) export and to_safetensors never write through a planted link ----------------------------


class _Config:
    """Stands in for a transformers config: ``save_pretrained`` writes ``config.json`` with plain ``open``."""

    def save_pretrained(self, path):
        with open(os.path.join(path, "config.json"), "w") as handle:
            json.dump({"model_type": "test"}, handle)


def _plant(folder, names, victims) -> dict:
    os.makedirs(folder, exist_ok=True)
    os.makedirs(victims, exist_ok=True)
    planted = {}
    for name in names:
        victim = victims / (name + ".victim")
        victim.write_bytes(b"precious " + name.encode())
        os.symlink(victim, folder / name)
        planted[victim] = victim.read_bytes()
    return planted


def test_export_does_not_write_through_planted_links(tmp_path):
    run = Run()
    run.model.config = _Config()
    out = tmp_path / "export"
    planted = _plant(out, ["model.safetensors.tmp", "model.safetensors", "config.json"], tmp_path / "victims")
    zinf.export(out, run.compiled)
    for victim, content in planted.items():
        assert victim.read_bytes() == content, victim
    assert not (out / "model.safetensors").is_symlink() and not (out / "config.json").is_symlink()
    assert not os.path.lexists(out / "model.safetensors.tmp")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    weights = safetensors_torch.load_file(out / "model.safetensors")
    assert torch.equal(weights["wte.weight"], zinf.full_state_dict(run.compiled)["wte.weight"])
    assert json.loads((out / "config.json").read_text()) == {"model_type": "test"}


def test_to_safetensors_does_not_write_through_planted_links(saved, tmp_path):
    good, run = saved
    out = tmp_path / "converted"
    planted = _plant(out, ["model.safetensors.tmp", "model.safetensors"], tmp_path / "victims")
    zinf.checkpoint.to_safetensors(good, out)
    for victim, content in planted.items():
        assert victim.read_bytes() == content, victim
    assert not (out / "model.safetensors").is_symlink() and not os.path.lexists(out / "model.safetensors.tmp")


# --- (b) names in a checkpoint stay inside its folder ---------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "absolute", "separator", "symlink"])
def test_a_data_file_outside_the_folder_is_refused(saved, tmp_path, how):
    """The data file is moved out (its CRCs still match): it must not become the weights."""
    good, run = saved
    folder = _copy(good, tmp_path / "ckpt")
    outside = tmp_path / "outside"
    os.makedirs(outside)
    os.rename(folder / DATA, outside / DATA)
    manifest = _read_json(folder / MANIFEST)
    name = {"dotdot": f"../outside/{DATA}", "absolute": str(outside / DATA), "separator": f"sub/{DATA}",
            "symlink": DATA}[how]
    if how == "separator":
        os.makedirs(folder / "sub")
        os.symlink(outside / DATA, folder / "sub" / DATA)
    if how == "symlink":
        os.symlink(outside / DATA, folder / DATA)
    manifest["data"]["file"] = name
    _reseal(folder, {MANIFEST: manifest})
    named = re.escape(name) if how == "symlink" else f"{MANIFEST}.*{re.escape(name)}"
    _refused(run, folder, named, outside=outside)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_a_manifest_outside_the_folder_is_refused(saved, tmp_path, how):
    good, run = saved
    folder = _copy(good, tmp_path / "ckpt")
    outside = tmp_path / "outside"
    os.makedirs(outside)
    os.rename(folder / MANIFEST, outside / MANIFEST)
    meta = _read_json(folder / "meta.json")
    crc = meta["manifests"].pop(MANIFEST)
    name = {"dotdot": f"../outside/{MANIFEST}", "absolute": str(outside / MANIFEST), "symlink": MANIFEST}[how]
    if how == "symlink":
        os.symlink(outside / MANIFEST, folder / MANIFEST)
    meta["manifests"][name] = crc
    _reseal(folder, meta=meta)
    _refused(run, folder, re.escape(name), outside=outside)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_an_extra_outside_the_folder_is_refused(saved, tmp_path, how):
    good, run = saved
    folder = _copy(good, tmp_path / "ckpt")
    outside = tmp_path / "outside"
    os.makedirs(outside)
    os.rename(folder / "extra.pt", outside / "extra.pt")
    meta = _read_json(folder / "meta.json")
    name = {"dotdot": "../outside/extra.pt", "absolute": str(outside / "extra.pt"), "symlink": "extra.pt"}[how]
    if how == "symlink":
        os.symlink(outside / "extra.pt", folder / "extra.pt")
    meta["extra"]["file"] = name
    _reseal(folder, meta=meta)
    _refused(run, folder, f"extra.*{re.escape(name)}", outside=outside)


def test_the_good_checkpoint_still_loads(saved):
    good, run = saved
    assert zinf.load(good, run.compiled, run.opt) == {"step": 1}


# --- (c) checksums cover the whole data file ------------------------------------------------------


def test_an_empty_crc_list_for_a_nonempty_data_file_is_refused(saved, tmp_path):
    good, run = saved
    folder = _copy(good, tmp_path / "ckpt")
    manifest = _read_json(folder / MANIFEST)
    assert manifest["data"]["bytes"] > 0
    manifest["data"]["crc32"] = []
    _reseal(folder, {MANIFEST: manifest})
    _refused(run, folder, f"{MANIFEST}.*crc32.*{DATA}")


def test_verify_data_file_wants_one_crc_per_block(tmp_path):
    path = tmp_path / "data.bin"
    data = bytes(range(256)) * ((2 * BLOCK_BYTES + 100) // 256 + 1)
    path.write_bytes(data)
    crcs = [zlib.crc32(data[i : i + BLOCK_BYTES]) for i in range(0, len(data), BLOCK_BYTES)]
    described = {"bytes": len(data), "block_bytes": BLOCK_BYTES, "crc32": crcs}
    verify_data_file(str(path), described)
    for crc32 in ([], crcs[:-1], crcs + [0]):
        with pytest.raises(zinf.ZinfCheckpointError, match="data.bin.*(CRC32|checksum)"):
            verify_data_file(str(path), {**described, "crc32": crc32})
    for block_bytes in (0, -1, 1.5, None):
        with pytest.raises(zinf.ZinfCheckpointError, match="data.bin.*block_bytes"):
            verify_data_file(str(path), {**described, "block_bytes": block_bytes})
    with pytest.raises(zinf.ZinfCheckpointError, match="data.bin.*crc32"):
        verify_data_file(str(path), {k: v for k, v in described.items() if k != "crc32"})


# --- (d) malformed entries: one error type ---------------------------------------------------------


def _malformed_cases():
    def manifest(edit):
        return ("manifest", edit)

    def meta(edit):
        return ("meta", edit)

    def first_entry(m):
        return next(e for e in m["entries"] if e["kind"] == "value")

    return {
        "manifest without data": manifest(lambda m: m.pop("data")),
        "manifest without entries": manifest(lambda m: m.pop("entries")),
        "entry without pieces": manifest(lambda m: first_entry(m).pop("pieces")),
        "entry with unknown dtype": manifest(lambda m: first_entry(m).update(dtype="float128")),
        "entry with a dtype of wrong type": manifest(lambda m: first_entry(m).update(dtype=["float32"])),
        "piece with two numbers": manifest(lambda m: first_entry(m)["pieces"][0].pop()),
        "negative offset": manifest(lambda m: first_entry(m)["pieces"][0].__setitem__(2, -8)),
        "offset past the file": manifest(lambda m: first_entry(m)["pieces"][0].__setitem__(2, m["data"]["bytes"])),
        "huge offset": manifest(lambda m: first_entry(m)["pieces"][0].__setitem__(2, 2**64)),
        "stop before first": manifest(lambda m: first_entry(m)["pieces"][0].__setitem__(0, 10**6)),
        "float count": manifest(lambda m: first_entry(m)["pieces"][0].__setitem__(1, 3.5)),
        "bytes not the file's size": manifest(lambda m: m["data"].update(bytes=m["data"]["bytes"] + 4)),
        "negative bytes": manifest(lambda m: m["data"].update(bytes=-1)),
        "scalars not a dict": manifest(lambda m: m.update(scalars=[1])),
        "step of wrong type": manifest(lambda m: next(iter(m["scalars"].values())).update(step="x")),
        "rng missing": manifest(lambda m: m.pop("rng")),
        "rng torch state too short": manifest(lambda m: m["rng"].update(torch="00")),
        "rng python state garbage": manifest(lambda m: m["rng"].update(python=[3, [1, 2], None])),
        "meta without params": meta(lambda m: m.pop("params")),
        "meta shape negative": meta(lambda m: next(iter(m["params"].values())).update(shape=[-1, 16])),
        "meta shape of strings": meta(lambda m: next(iter(m["params"].values())).update(shape=["a"])),
        "meta world size 0": meta(lambda m: m.update(world_size=0)),
        "meta world size 2 with one manifest": meta(lambda m: m.update(world_size=2)),
        "meta manifests a list": meta(lambda m: m.update(manifests=[MANIFEST])),
        "meta manifest crc a string": meta(lambda m: m["manifests"].update({MANIFEST: "x"})),
        "meta scaler missing": meta(lambda m: m.pop("fp16_scaler")),
        "meta scaler of wrong type": meta(lambda m: m["fp16_scaler"].update(scale="big")),
        "meta param groups not a list": meta(lambda m: m["optimizer"].update(param_groups={})),
        "meta lr a string": meta(lambda m: m["optimizer"]["param_groups"][0].update(lr="fast")),
        "meta optimizer class a number": meta(lambda m: m["optimizer"].update({"class": 3})),
        "meta extra without crc": meta(lambda m: m["extra"].pop("crc32")),
        "meta is a list": ("meta-replace", []),
    }


MALFORMED = _malformed_cases()


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_entries_raise_zinf_checkpoint_error(saved, tmp_path, case):
    good, run = saved
    folder = _copy(good, tmp_path / "ckpt")
    where, edit = MALFORMED[case]
    if where == "manifest":
        manifest = _read_json(folder / MANIFEST)
        edit(manifest)
        _reseal(folder, {MANIFEST: manifest})
    elif where == "meta":
        meta = _read_json(folder / "meta.json")
        edit(meta)
        _reseal(folder, meta=meta)
    else:
        _reseal(folder, meta=edit)
    named = {"meta lr a string": "param group 0's lr"}.get(case, MANIFEST if where == "manifest" else "meta.json")
    _refused(run, folder, re.escape(named))


def test_a_commit_marker_or_meta_that_is_a_link_or_a_folder_is_refused(saved, tmp_path):
    good, run = saved
    folder = _copy(good, tmp_path / "ckpt")
    outside = tmp_path / "outside"
    os.makedirs(outside)
    os.rename(folder / "meta.json", outside / "meta.json")
    os.symlink(outside / "meta.json", folder / "meta.json")
    _refused(run, folder, "meta.json", outside=outside)
    os.unlink(folder / "meta.json")
    os.makedirs(folder / "meta.json")
    _refused(run, folder, "meta.json")


def test_extra_is_loaded_weights_only_and_a_pickle_is_refused(saved, tmp_path):
    """A pickle that runs code is refused by default (weights_only=True), as a ZinfCheckpointError."""
    good, run = saved
    folder = _copy(good, tmp_path / "ckpt")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    os.unlink(folder / "extra.pt")
    torch.save({"x": Evil()}, folder / "extra.pt")
    meta = _read_json(folder / "meta.json")
    meta["extra"]["crc32"] = zlib.crc32((folder / "extra.pt").read_bytes())
    _reseal(folder, meta=meta)
    _refused(run, folder, "extra.pt.*weights_only")
    assert not marker.exists()


_NASTY = [None, True, -1, 0, 1, 7, 2**31, 2**63, 2**64 + 5, -(2**63) - 1, 1.5, -0.5, float("nan"), float("inf"),
          "", "x", "float32", "../x", "/etc/passwd", "a/b", [], {}, [0], [-1, 5, 0], [0, 2**62, 0], {"a": 1}]


def _paths(obj, prefix=()):
    """Every (path, value) in a JSON tree."""
    yield prefix, obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for index, value in enumerate(obj[:6]):
            yield from _paths(value, prefix + (index,))


@st.composite
def _mutations(draw):
    which = draw(st.sampled_from(["meta.json", MANIFEST]))
    operation = draw(st.sampled_from(["replace", "delete", "nudge"]))
    return which, operation, draw(st.integers(0, 10**6)), copy.deepcopy(draw(st.sampled_from(_NASTY))), \
        draw(st.sampled_from([-(2**40), -1, 1, 8, 2**40]))


def _as_written(folder, docs: dict, saved_meta: dict, before: dict) -> dict:
    """The state a load of ``folder`` must give, read here in a few lines apart from zinf's reader: each
    parameter's and moment's elements are the bytes its manifest entry points at (in the entry's dtype), the
    step counts, hyperparameters and RNG states are as written. (A resealed edit is a checkpoint that says
    other things, not a damaged one: an offset moved within the data file points at other bytes, which is
    what the load must then take.) ``saved_meta``: the unedited meta.json, for what the model fixes (which
    parameter is which optimizer index, tied names); ``before``: the state of the good checkpoint, for the
    shapes and the settings a checkpoint does not carry."""
    meta, manifest = docs["meta.json"], docs[MANIFEST]
    data = (folder / manifest["data"]["file"]).read_bytes()
    numel = {name: value.numel() for name, value in before["model"].items()}
    flat = {}
    for entry in manifest["entries"]:
        dtype = getattr(torch, entry["dtype"])
        values = flat.setdefault((entry["name"], entry["kind"]), torch.full((numel[entry["name"]],), float("nan")))
        for first, stop, offset in entry["pieces"]:
            if stop > first:
                piece = bytearray(data[offset: offset + (stop - first) * dtype.itemsize])
                values[first:stop] = torch.frombuffer(piece, dtype=dtype).float()
    owner = {alias: name for name, info in saved_meta["params"].items() for alias in info["aliases"]}
    model = {name: flat[(owner[name], "value")].view_as(value) for name, value in before["model"].items()}
    names = [name for group in saved_meta["optimizer"]["param_groups"] for name in group["params"]]
    moments = {}
    for (index, kind), value in before["moments"].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            moments[index, kind] = flat[(names[index], f"state.{kind}")][: value.numel()].view_as(value)
        else:
            number, dtype = manifest["scalars"][names[index]][kind]
            moments[index, kind] = torch.tensor(number, dtype=getattr(torch, dtype))
    groups = [{**group, **{key: value for key, value in written.items() if key in group}}
              for group, written in zip(before["groups"], meta["optimizer"]["param_groups"])]
    version, words, gauss = manifest["rng"]["python"]
    return {"model": model, "moments": moments, "groups": groups,
            "rng": torch.tensor(list(bytes.fromhex(manifest["rng"]["torch"])), dtype=torch.uint8),
            "python_rng": (version, tuple(words), gauss)}


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(mutations=st.lists(_mutations(), min_size=1, max_size=3))
def test_any_mutation_of_a_saved_manifest_is_loaded_as_written_or_refused(saved, tmp_path_factory, mutations):
    """Mutate meta.json and the manifest (CRCs resealed): a load either raises ZinfCheckpointError and changes
    nothing, or it loads exactly what the mutated files say (an unchanged field: the original) and returns the
    extra they name."""
    good, run = saved
    folder = _copy(good, tmp_path_factory.mktemp("mutated") / "ckpt")
    docs = {"meta.json": _read_json(folder / "meta.json"), MANIFEST: _read_json(folder / MANIFEST)}
    saved_meta = copy.deepcopy(docs["meta.json"])
    for which, operation, pick, nasty, delta in mutations:
        paths = list(_paths(docs[which]))
        path, value = paths[pick % len(paths)]
        if not path:
            if operation == "replace":
                docs[which] = nasty
            continue
        parent = docs[which]
        for key in path[:-1]:
            parent = parent[key]
        if not isinstance(parent, (dict, list)):
            continue
        if operation == "delete":
            del parent[path[-1]]
        elif operation == "nudge" and isinstance(value, (int, float)) and not isinstance(value, bool):
            parent[path[-1]] = value + delta
        else:
            parent[path[-1]] = nasty
    _reseal(folder, {MANIFEST: docs[MANIFEST]}, meta=docs["meta.json"])
    docs = {"meta.json": _read_json(folder / "meta.json"), MANIFEST: _read_json(folder / MANIFEST)}  # as resealed
    zinf.load(good, run.compiled, run.opt)
    before = run.state()
    try:
        extra = zinf.load(folder, run.compiled, run.opt)
    except zinf.ZinfCheckpointError as err:
        assert str(err), err
        assert _same(run.state(), before)
    else:
        assert _differing(run.state(), _as_written(folder, docs, saved_meta, before)) == [], mutations
        assert extra == ({"step": 1} if "extra" in docs["meta.json"] else None)
    finally:
        zinf.load(good, run.compiled, run.opt)


@pytest.mark.parametrize("which,path,value", [
    ("meta.json", ("optimizer", "param_groups", 0, "lr"), 7),
    ("meta.json", ("optimizer", "param_groups", 0, "betas"), [0.5, 0.75]),
    (MANIFEST, ("scalars", "ln_f.bias", "step", 0), 9.0),
    (MANIFEST, ("rng", "python", 1, 3), 5),
    ("meta.json", ("extra",), None),  # deleted: the load returns no extra
], ids=["lr", "betas", "step", "python-rng", "no-extra"])
def test_an_edited_checkpoint_that_is_still_valid_loads_as_written(saved, tmp_path, which, path, value):
    # What the property test above holds a successful load to, on edits that must load: values a checkpoint
    # carries, rewritten and resealed, are a checkpoint that says other things, not a damaged one.
    good, run = saved
    folder = _copy(good, tmp_path / "ckpt")
    docs = {"meta.json": _read_json(folder / "meta.json"), MANIFEST: _read_json(folder / MANIFEST)}
    saved_meta = copy.deepcopy(docs["meta.json"])
    parent = docs[which]
    for key in path[:-1]:
        parent = parent[key]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    _reseal(folder, {MANIFEST: docs[MANIFEST]}, meta=docs["meta.json"])
    zinf.load(good, run.compiled, run.opt)
    before = run.state()
    try:
        extra = zinf.load(folder, run.compiled, run.opt)
        after = run.state()
        assert _differing(after, _as_written(folder, docs, saved_meta, before)) == []
        assert not _same(after, before) or value is None
        assert extra == (None if value is None else {"step": 1})
    finally:
        zinf.load(good, run.compiled, run.opt)


def test_sgd_momentum_state_resumes_without_a_step_count(tmp_path):
    """SGD's state is its momentum buffer alone: no step count is required of it (Adam's is)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    compiled = torch.compile(model, backend="zinf", options={"lower": "eager", "stage": 3})
    opt = zinf.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    for idx, targets in BATCHES:
        compiled(idx, targets).backward()
        opt.step()
        opt.zero_grad()
    zinf.save(tmp_path / "sgd", compiled, opt)
    saved = {index: state["momentum_buffer"].clone() for index, state in opt.state_dict()["state"].items()}
    for state in opt._inner.state.values():
        state["momentum_buffer"].zero_()
    zinf.load(tmp_path / "sgd", compiled, opt)
    loaded = opt.state_dict()["state"]
    assert saved and all(torch.equal(loaded[index]["momentum_buffer"], saved[index]) for index in saved)


# --- (e) publishing a save never follows a link ----------------------------------------------------


@pytest.mark.parametrize("planted", [".old", ".partial"])
def test_a_symlinked_old_or_partial_folder_is_not_followed(tmp_path, planted):
    run = Run()
    path = tmp_path / "ckpt"
    zinf.save(path, run.compiled, run.opt)  # a checkpoint at path: the next save moves it aside to .old
    victim = tmp_path / "victim"
    os.makedirs(victim)
    (victim / "precious.txt").write_text("precious")
    os.symlink(victim, str(path) + planted)
    zinf.save(path, run.compiled, run.opt)
    assert sorted(os.listdir(victim)) == ["precious.txt"]
    assert (victim / "precious.txt").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "victim"]
    zinf.load(path, run.compiled, run.opt)


def test_a_failed_publish_leaves_no_partial_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run = Run()
    path = tmp_path / "ckpt"
    zinf.save(path, run.compiled, run.opt, extra={"n": 1})
    real_rename = os.rename

    def rename(source, target):
        if str(source).endswith(".partial"):
            raise OSError(28, "No space left on device")
        return real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(zinf.ZinfCheckpointError, match="ckpt"):
        zinf.save(path, run.compiled, run.opt, extra={"n": 2})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert zinf.load(path, run.compiled, run.opt) == {"n": 1}
