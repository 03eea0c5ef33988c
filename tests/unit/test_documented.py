"""Every module, and every public class, function and method in zinf_compiler, says what it is (issue 27).

Read from the source (no import), so a name added without a docstring fails here
rather than in a reviewer's reading.
"""

from __future__ import annotations

import ast
import pathlib

import zinf_compiler
import zinf_compiler.passes
import zinf_compiler.runtime

# The three packages (runtime/ and passes/ sit beside zinf_compiler/ in the repository).
PACKAGES = [pathlib.Path(package.__file__).parent
            for package in (zinf_compiler, zinf_compiler.passes, zinf_compiler.runtime)]


def _undocumented(path: pathlib.Path, root: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = str(path.relative_to(root))
    missing = [] if ast.get_docstring(tree) else [f"{where}: the module"]

    def visit(body, prefix: str) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_"):
                continue  # private, and dunders (documented by the protocol they implement)
            if not ast.get_docstring(node):
                missing.append(f"{where}:{node.lineno} {prefix}{node.name}")
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return missing


def test_every_public_name_has_a_docstring():
    files = [(path, package.parent) for package in PACKAGES for path in sorted(package.rglob("*.py"))]
    assert len(files) > 50, f"read only {len(files)} files: is the package layout what this test expects?"
    missing = [entry for path, root in files for entry in _undocumented(path, root)]
    assert not missing, "public names without a docstring:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_docstring(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text('class Shown:\n    """Said."""\n\n    def bare(self):\n        pass\n\n    def _private(self):\n'
                      '        pass\n')
    assert _undocumented(source, tmp_path) == ["probe.py: the module", "probe.py:4 Shown.bare"]
