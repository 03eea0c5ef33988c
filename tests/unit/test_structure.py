"""The layers' import rules and the size limits (issue 36, acceptance 1 and 4), read from the source.

Every module of zinf_compiler/, passes/ (``zinf_compiler.passes``) and runtime/
(``zinf_compiler.runtime``) is parsed with :mod:`ast`, nothing imported: an
``import`` anywhere in a file counts, at module level or inside a function, since
a circle closed at call time is still a circle in the design.  The rules:

- no import circle among runtime/ modules, none among passes/ modules, none among
  zinf_compiler/'s own top-level modules;
- only the entry layer (:data:`ENTRY_LAYER`: api.py, backend.py, optim.py) imports
  runtime/process.py or names the process's runtime instance ``RUNTIME``; everything
  else is handed the parts it uses;
- runtime/ imports nothing of zinf_compiler/ or passes/ (the runtime knows nothing of
  the compile side); passes/ reads of runtime/ only layouts and constants
  (:data:`RUNTIME_FOR_PASSES`);
- no module imports a layer above its own: runtime/, the compile side (zinf_compiler/
  and passes/), the entry layer, the top layer (:data:`TOP_LAYER`: what users call that
  is built on the entry layer, such as checkpoint/);
- no file over :data:`MAX_FILE_LINES` lines, no class over :data:`MAX_CLASS_LINES`.

Importing a submodule runs its parent packages' ``__init__`` too; those implicit
imports are not edges here (they would make every module reach every other through
``zinf_compiler/__init__.py``), only what a file names is.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import zinf_compiler
import zinf_compiler.passes
import zinf_compiler.runtime

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "zinf_compiler"
RUNTIME_PACKAGE = "zinf_compiler.runtime"
PASSES_PACKAGE = "zinf_compiler.passes"
# The package each folder is installed as (pyproject.toml's package-dir).
FOLDERS = {name: pathlib.Path(package.__file__).parent
           for name, package in ((PACKAGE, zinf_compiler), (PASSES_PACKAGE, zinf_compiler.passes),
                                 (RUNTIME_PACKAGE, zinf_compiler.runtime))}
# The only modules that may reach the process's runtime instance (see runtime/process.py).
ENTRY_LAYER = {"zinf_compiler.api", "zinf_compiler.backend", "zinf_compiler.optim"}
PROCESS_MODULE = "zinf_compiler.runtime.process"
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 400


def module_files(folders: dict[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every ``*.py`` in each package folder and its sub-packages (such as
    zinf_compiler/checkpoint/; an ``__init__`` is its package itself)."""
    modules = {}
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _imported_modules(module: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that an ``import`` in ``path`` names, relative imports resolved: ``from A
    import b`` reaches ``A.b`` where that is a module, else ``A`` itself."""
    package_parts = module.split(".") if path.stem == "__init__" else module.split(".")[:-1]
    reached = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            reached.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package_parts[: len(package_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                reached.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in reached if name in modules and name != module}


def import_graph(folders: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``folders`` it imports by name (see the module docstring)."""
    modules = module_files(folders)
    return {module: _imported_modules(module, path, set(modules)) for module, path in modules.items()}


def circles(graph: dict[str, set[str]], members: set[str]) -> list[list[str]]:
    """The import circles among ``members``: each strongly connected set of more than one module (Tarjan),
    sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:  # (the graphs here are a few dozen modules deep at most)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in members:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(members):
        if node not in index:
            visit(node)
    return sorted(found)


def layers(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """runtime/, passes/ and zinf_compiler/'s own modules, each a set of module names."""
    runtime = {m for m in graph if m == RUNTIME_PACKAGE or m.startswith(RUNTIME_PACKAGE + ".")}
    passes = {m for m in graph if m == PASSES_PACKAGE or m.startswith(PASSES_PACKAGE + ".")}
    return {"runtime/": runtime, "passes/": passes, "zinf_compiler/": set(graph) - runtime - passes}


def _describe(found: list[list[str]]) -> str:
    return "\n".join("  " + " <-> ".join(circle) for circle in found)


def test_no_import_circle_within_a_layer():
    graph = import_graph(FOLDERS)
    assert len(graph) > 50, f"read only {len(graph)} modules: is the package layout what this test expects?"
    assert "zinf_compiler.checkpoint.saving" in graph, "sub-packages' modules must be read too"
    problems = []
    for layer, members in layers(graph).items():
        found = circles(graph, members)
        if found:
            problems.append(f"{layer} has import circles (imports inside functions count):\n{_describe(found)}")
    assert not problems, "\n".join(problems)


def test_only_the_entry_layer_imports_the_process_runtime():
    graph = import_graph(FOLDERS)
    importers = sorted(m for m, targets in graph.items() if PROCESS_MODULE in targets and m not in ENTRY_LAYER)
    assert not importers, (f"{PROCESS_MODULE} is imported outside the entry layer {sorted(ENTRY_LAYER)} by "
                           f"{importers}: hand them the parts they use instead")


def test_only_the_entry_layer_names_the_runtime_instance():
    named = re.compile(r"\bRUNTIME\b")
    offenders = []
    for module, path in module_files(FOLDERS).items():
        if module in ENTRY_LAYER:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if named.search(line):
                offenders.append(f"  {path.parent.name}/{path.name}:{number}: {line.strip()}")
    assert not offenders, "RUNTIME named outside the entry layer:\n" + "\n".join(offenders)


def test_the_runtime_imports_nothing_of_the_compile_side():
    graph = import_graph(FOLDERS)
    runtime = layers(graph)["runtime/"]
    reaching = sorted(f"  {m} imports {sorted(graph[m] - runtime)}" for m in runtime if graph[m] - runtime)
    assert not reaching, "runtime/ imports zinf_compiler/ or passes/ modules:\n" + "\n".join(reaching)


# What passes/ may read of the runtime: layouts, vocabularies and constants, never a store or an engine
# (passes never touch files, threads or state that outlives the compile).
RUNTIME_FOR_PASSES = {f"{RUNTIME_PACKAGE}.{name}" for name in ("units", "tiers", "buckets", "swap_layout", "records")}


def test_passes_read_only_layouts_and_constants_of_the_runtime():
    graph = import_graph(FOLDERS)
    groups = layers(graph)
    reaching = sorted(f"  {m} imports {sorted((graph[m] & groups['runtime/']) - RUNTIME_FOR_PASSES)}"
                      for m in groups["passes/"] if (graph[m] & groups["runtime/"]) - RUNTIME_FOR_PASSES)
    assert not reaching, (f"passes/ imports runtime modules beyond {sorted(RUNTIME_FOR_PASSES)}:\n"
                          + "\n".join(reaching))


# The top layer: what users call that is built on the entry layer (docs/architecture.md): the package's public
# namespace, the checkpoints, the Hugging Face helpers and the pipeline stage.
TOP_LAYER = {PACKAGE, f"{PACKAGE}.hf", f"{PACKAGE}.pipeline_parallel"}
TOP_LAYER_PACKAGES = (f"{PACKAGE}.checkpoint",)
LAYER_NAMES = ("runtime/", "the compile side (zinf_compiler/ and passes/)", "the entry layer", "the top layer")


def layer_of(module: str) -> int:
    """The module's layer, lowest first: 0 runtime/, 1 the compile side (passes/ with it), 2 the entry layer
    (:data:`ENTRY_LAYER`), 3 the top layer."""
    if module == RUNTIME_PACKAGE or module.startswith(RUNTIME_PACKAGE + "."):
        return 0
    if module in TOP_LAYER or any(module == p or module.startswith(p + ".") for p in TOP_LAYER_PACKAGES):
        return 3
    return 2 if module in ENTRY_LAYER else 1


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module in a layer above the importer's, as ``  importer (layer) -> imported (layer)``."""
    return [f"  {module} ({LAYER_NAMES[layer_of(module)]}) -> {target} ({LAYER_NAMES[layer_of(target)]})"
            for module, targets in sorted(graph.items()) for target in sorted(targets)
            if layer_of(target) > layer_of(module)]


def test_no_module_imports_a_layer_above_its_own():
    graph = import_graph(FOLDERS)
    assert {layer_of(m) for m in graph} == {0, 1, 2, 3}, "a layer has no module: is the layout what this expects?"
    found = upward_imports(graph)
    assert not found, "imports against the layers of docs/architecture.md:\n" + "\n".join(found)


def test_the_check_sees_planted_upward_imports():
    planted = {"zinf_compiler.planner": {"zinf_compiler.api", "zinf_compiler.options"},
               "zinf_compiler.optim": {"zinf_compiler.checkpoint.saving", "zinf_compiler.runtime.store"},
               "zinf_compiler.runtime.store": {"zinf_compiler.passes.tile"},
               "zinf_compiler.hf": {"zinf_compiler.optim", "zinf_compiler.checkpoint.loading"}}
    assert upward_imports(planted) == [
        "  zinf_compiler.optim (the entry layer) -> zinf_compiler.checkpoint.saving (the top layer)",
        "  zinf_compiler.planner (the compile side (zinf_compiler/ and passes/)) -> zinf_compiler.api (the entry layer)",
        "  zinf_compiler.runtime.store (runtime/) -> zinf_compiler.passes.tile (the compile side (zinf_compiler/ and "
        "passes/))"]


# --- ParamRecord's fields: each assigned by the one module that owns its transitions (issue 53, acceptance 3) ---

# Objects of the same attribute names that are not records: (module, the name the object goes by there).
NOT_RECORDS = {("zinf_compiler.backend", "captured")}  # a captured graph's mesh


def _assigned_attributes(tree: ast.AST):
    """``(line, object expression, attribute)`` of every attribute assigned in ``tree`` (``=``, ``+=``, annotated,
    unpacked, ``setattr`` with a constant name), but an object's own (``self.x = ...``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            targets = [ast.Attribute(value=node.args[0], attr=node.args[1].value, lineno=node.lineno)]
        else:
            continue
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List, ast.Starred)):
                targets.extend(target.elts if not isinstance(target, ast.Starred) else [target.value])
            elif isinstance(target, ast.Attribute) and not (isinstance(target.value, ast.Name)
                                                            and target.value.id == "self"):
                yield node.lineno, ast.unparse(target.value), target.attr


def misassigned_fields(modules: dict[str, pathlib.Path], owners: dict[str, str | None]) -> list[str]:
    """Every assignment of a field of ``owners`` (field -> its owning module, None: assigned by none) outside its
    owner, as ``  module:line  expression.field (owned by ...)``."""
    found = []
    for module, path in sorted(modules.items()):
        for line, obj, attr in _assigned_attributes(ast.parse(path.read_text())):
            if attr in owners and owners[attr] != module and (module, obj) not in NOT_RECORDS:
                found.append(f"  {module}:{line}  {obj}.{attr} (owned by {owners[attr] or 'no module: fixed'})")
    return found


def test_every_record_field_is_assigned_by_its_owner_alone():
    import dataclasses

    from zinf_compiler.runtime.records import FIELD_OWNERS, ParamRecord
    fields = {field.name for field in dataclasses.fields(ParamRecord)}
    assert fields == set(FIELD_OWNERS), f"records.FIELD_OWNERS names no owner for {sorted(fields - set(FIELD_OWNERS))}"
    modules = module_files(FOLDERS)
    assert {owner for owner in FIELD_OWNERS.values() if owner} <= set(modules)
    found = misassigned_fields(modules, FIELD_OWNERS)
    assert not found, "ParamRecord fields assigned outside their owning module (runtime/records.py FIELD_OWNERS):\n" \
        + "\n".join(found)


def test_a_gradient_changes_only_by_its_own_moves():
    from zinf_compiler.runtime.grad_state import Gradient
    owners = {slot: f"{RUNTIME_PACKAGE}.grad_state" for slot in Gradient.__slots__ if slot.startswith("_")}
    found = misassigned_fields(module_files(FOLDERS), owners)
    assert not found, "a Gradient's state assigned outside runtime/grad_state.py:\n" + "\n".join(found)


def test_the_check_sees_planted_field_assignments(tmp_path):
    texts = {"zinf_compiler.loader": "def load(record, rec, v):\n    record.shard = v\n    rec.synced_version += 1\n"
                                     "    a, rec.master = v\n    setattr(record, 'swap', v)\n    self.shard = v\n",
             "zinf_compiler.backend": "captured.mesh = 1\nrecord.mesh = 2\n"}
    planted = {}
    for module, text in texts.items():
        planted[module] = tmp_path / f"{module}.py"
        planted[module].write_text(text)
    owners = {"shard": "m.values", "master": "m.values", "synced_version": "m.publish", "swap": "m.store",
              "mesh": None}
    assert misassigned_fields(planted, owners) == [
        "  zinf_compiler.backend:2  record.mesh (owned by no module: fixed)",
        "  zinf_compiler.loader:2  record.shard (owned by m.values)",
        "  zinf_compiler.loader:3  rec.synced_version (owned by m.publish)",
        "  zinf_compiler.loader:4  rec.master (owned by m.values)",
        "  zinf_compiler.loader:5  record.swap (owned by m.store)"]


def oversized(path: pathlib.Path) -> list[str]:
    """What in ``path`` is over the size limits: the file itself, and each class (nested ones too)."""
    source = path.read_text()
    where = f"{path.parent.name}/{path.name}"
    found = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        found.append(f"  {where}: {lines} lines (at most {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.ClassDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_CLASS_LINES:
                found.append(f"  {where}:{node.lineno} class {node.name}: {length} lines (at most {MAX_CLASS_LINES})")
    return found


def test_no_file_or_class_over_the_size_limits():
    found = [entry for path in module_files(FOLDERS).values() for entry in oversized(path)]
    assert not found, "over the size limits:\n" + "\n".join(found)


def test_every_package_folder_is_in_the_distribution():
    """A sub-package pyproject.toml does not list is left out of a built wheel, and an editable install (what
    the setup scripts do) hides that: found when ``pip install .`` on the GPU machine lost
    zinf_compiler/checkpoint/."""
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    for package, folder in setup["package-dir"].items():
        for init in sorted((REPO / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(REPO / folder).parts
            assert ".".join((package, *parts)) in listed, f"{init.parent} is not in pyproject.toml's packages"


def _plant(tmp_path: pathlib.Path, files: dict[str, str]) -> dict[str, pathlib.Path]:
    folder = tmp_path / "runtime"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return {RUNTIME_PACKAGE: folder}


def test_the_check_sees_a_planted_circle(tmp_path):
    # ``a`` imports ``b`` at module level; ``b`` imports ``a`` only inside a function, relatively: still a circle.
    # ``c`` imports ``a`` (not in the circle); ``d`` imports the package and a name of ``c``.
    folders = _plant(tmp_path, {
        "__init__.py": "",
        "a.py": "from zinf_compiler.runtime import b\n",
        "b.py": "def later():\n    from .a import thing\n    return thing\n",
        "c.py": "import zinf_compiler.runtime.a\n",
        "d.py": "from . import c\nfrom .c import name\n",
    })
    graph = import_graph(folders)
    assert graph["zinf_compiler.runtime.b"] == {"zinf_compiler.runtime.a"}
    assert graph["zinf_compiler.runtime.d"] == {"zinf_compiler.runtime.c"}
    assert circles(graph, set(graph)) == [["zinf_compiler.runtime.a", "zinf_compiler.runtime.b"]]


def test_the_check_passes_a_circle_free_set_and_sees_a_long_circle(tmp_path):
    folders = _plant(tmp_path, {"a.py": "from . import b\n", "b.py": "from . import c\n", "c.py": "x = 1\n"})
    assert circles(import_graph(folders), set(import_graph(folders))) == []
    (folders[RUNTIME_PACKAGE] / "c.py").write_text("def f():\n    import zinf_compiler.runtime.a\n")
    graph = import_graph(folders)
    assert circles(graph, set(graph)) == [[f"{RUNTIME_PACKAGE}.a", f"{RUNTIME_PACKAGE}.b", f"{RUNTIME_PACKAGE}.c"]]


def test_the_check_sees_an_oversized_class(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES + "\n\nclass Small:\n    y = 2\n")
    assert oversized(probe) == [f"  {tmp_path.name}/probe.py:1 class Big: {MAX_CLASS_LINES + 1} lines "
                                f"(at most {MAX_CLASS_LINES})"]


# The repository speaks of dates and commits, never of the work sessions that made it (a word of this project's
# history that means nothing to a reader). (The pattern is split so that this file does not match it.)
WORK_SESSION = re.compile(r"\bsess" + r"ions? [0-9]", re.IGNORECASE)
TEXT_PLACES = ("README.md", "pyproject.toml", ".ci", "benchmarks", "docs", "examples", "passes", "runtime", "scripts",
               "tests", "zinf_compiler")


def work_sessions_named(root: pathlib.Path) -> list[str]:
    """``path:line`` of every line under ``root``'s text places that names a work session by number."""
    found = []
    for place in TEXT_PLACES:
        paths = [root / place] if (root / place).is_file() else sorted((root / place).rglob("*"))
        for path in paths:
            if not path.is_file() or path.suffix not in ("", ".py", ".md", ".sh", ".toml", ".txt", ".json"):
                continue
            try:
                lines = path.read_text().splitlines()
            except (UnicodeDecodeError, OSError):
                continue
            found += [f"  {path.relative_to(root)}:{number}: {line.strip()[:100]}"
                      for number, line in enumerate(lines, 1) if WORK_SESSION.search(line)]
    return found


def test_no_text_names_a_work_session():
    found = work_sessions_named(REPO)
    assert not found, "dates and commits, not work sessions:\n" + "\n".join(found)


def test_the_check_sees_a_planted_work_session(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("measured on 2026-11-27\nas " + "Sess" + "ion 12 found\n")
    assert work_sessions_named(tmp_path) == ["  docs/notes.md:2: as " + "Sess" + "ion 12 found"]
