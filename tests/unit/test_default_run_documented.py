"""What tests/README.md and the tests' slow-marker comments say the default run covers is what it collects.

The README's tables name tests with backticked references (its section "Where each module is tested" gives
the grammar): ``path``, ``path::test``, ``path::test[id]`` or ``path[id]``, the path relative to tests/
(``integration/`` when it names no folder).  Checked against ``pytest --collect-only`` (one subprocess,
``-m ""``, each item with whether it is marked slow):

* every reference names collected tests;
* the feature table's "default run" column names tests the default run (``-m "not slow"``) collects, its
  "also in --all" column tests that only ``--all`` runs;
* in the module table a reference followed by ``(slow`` names tests that only ``--all`` runs, and any other
  names at least one test the default run collects;
* a comment on a line that marks tests slow names, with the same references or a bare test or module name
  (``test_zero``, ``test_two_instances_of_one_class_train_their_own_weights``), what covers them by default:
  each must be collected by the default run.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass

import pytest

from repo_paths import REPO

TESTS = REPO / "tests"
TIERS = ("unit", "integration", "multirank")
REFERENCE = re.compile(r"^(?:(?P<folder>unit|integration|multirank)/)?(?P<module>test_\w+)\.py"
                       r"(?:::(?P<test>test_\w+))?(?:\[(?P<id>[^\]]+)\])?$")
# In a comment: the same, or a bare name (a test function of that file, or a module beside it).
COMMENT_REFERENCE = re.compile(r"(?:(?:unit|integration|multirank)/)?test_\w+(?:\.py)?(?:::test_\w+)?(?:\[[^\]\s]+\])?")

_COLLECT = """
import json, sys
import pytest

class Items:
    items = []

    def pytest_collection_finish(self, session):
        self.items = [[item.nodeid, item.get_closest_marker("slow") is not None] for item in session.items]

items = Items()
code = pytest.main(["--collect-only", "-q", "-m", "", "-p", "no:cacheprovider", "tests"], plugins=[items])
with open(sys.argv[1], "w") as handle:
    json.dump({"code": int(code), "items": items.items}, handle)
"""


@dataclass(frozen=True)
class Item:
    path: str  # relative to tests/, e.g. "integration/test_trace.py"
    test: str
    id: str | None
    slow: bool


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> list[Item]:
    """Every test of the suite as pytest collects it (``-m ""``), with whether it is marked slow."""
    out = tmp_path_factory.mktemp("collected") / "items.json"
    env = {name: value for name, value in os.environ.items() if name != "PYTEST_ADDOPTS"}  # the plain collection
    done = subprocess.run([sys.executable, "-c", _COLLECT, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["code"] == 0, result
    items = []
    for nodeid, slow in result["items"]:
        path, _, name = nodeid.partition("::")
        test, _, param = name.partition("[")
        items.append(Item(path.removeprefix("tests/"), test, param[:-1] if param else None, slow))
    assert len(items) > 300 and any(item.slow for item in items), f"collected {len(items)} items"
    return items


def _matches(reference: str, items: list[Item]) -> list[Item]:
    """The items a README reference names (none if it is not one)."""
    match = REFERENCE.match(reference)
    if match is None:
        return []
    path = f"{match['folder'] or 'integration'}/{match['module']}.py"
    return [item for item in items if item.path == path and match["test"] in (None, item.test)
            and match["id"] in (None, item.id)]


def _table_rows(section: str) -> list[list[str]]:
    """The body rows of the first table under the README heading ``section``, as lists of cells."""
    text = (TESTS / "README.md").read_text()
    start = text.index(f"## {section}")
    end = text.find("\n## ", start + 1)
    lines = [line for line in text[start: end if end > 0 else None].splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def _references(cell: str) -> list[tuple[str, str]]:
    """(reference, the text that follows its closing backtick) for each backticked test reference in ``cell``."""
    return [(found.group(1), cell[found.end():]) for found in re.finditer(r"`([^`]+)`", cell)
            if REFERENCE.match(found.group(1))]


def test_every_reference_in_the_readme_names_collected_tests(collected):
    rows = _table_rows("Where each module is tested") + _table_rows("Where each feature is tested")
    references = [reference for row in rows for cell in row for reference, _ in _references(cell)]
    assert len(references) > 50, "the README's tables were not found where this test reads them"
    unknown = [reference for reference in references if not _matches(reference, collected)]
    assert not unknown, "names no collected test: " + ", ".join(unknown)


def test_the_feature_tables_default_and_all_columns_are_what_each_run_collects(collected):
    rows = _table_rows("Where each feature is tested")
    default_run = [reference for _, default, _ in rows for reference, _ in _references(default)]
    all_only = [reference for _, _, also in rows for reference, _ in _references(also)]
    assert default_run and all_only
    not_default = [ref for ref in default_run if not any(not item.slow for item in _matches(ref, collected))]
    assert not not_default, "in the default-run column, but only --all runs it: " + ", ".join(not_default)
    not_slow = [ref for ref in all_only if not any(item.slow for item in _matches(ref, collected))]
    assert not not_slow, "in the --all column, but the default run has all of it: " + ", ".join(not_slow)


def test_the_module_table_marks_slow_exactly_the_references_the_default_run_leaves_out(collected):
    marked_wrongly = []
    for _, tests in _table_rows("Where each module is tested"):
        for reference, after in _references(tests):
            in_default = any(not item.slow for item in _matches(reference, collected))
            if after.startswith(" (slow") == in_default:
                marked_wrongly.append(f"{reference}{after[:20]}")
    assert not marked_wrongly, ("marked (slow) but in the default run, or only in --all and not marked:\n"
                                + "\n".join(marked_wrongly))


def _comment_references(path, comment: str, items: list[Item]) -> dict[str, list[Item]]:
    """The tests a slow-marker comment in ``path`` names, by the name it gives them."""
    folder = path.parent.name
    named = {}
    for name in COMMENT_REFERENCE.findall(comment):
        if ".py" in name:
            reference = name if "/" in name or folder == "integration" else f"{folder}/{name}"
            named[name] = _matches(reference, items) or _matches(name, items)
        else:
            test, _, param = name.partition("[")
            own = [item for item in items if item.path == f"{folder}/{path.name}" and item.test == test
                   and (not param or item.id == param[:-1])]
            named[name] = own or _matches(f"{folder}/{name}.py", items) or _matches(f"{name}.py", items)
    return named


def test_slow_marker_comments_name_tests_the_default_run_collects(collected):
    claims, unresolved, not_default = 0, [], []
    for path in sorted(TESTS.glob("*/test_*.py")):
        if path.parent.name not in TIERS:
            continue
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type != tokenize.COMMENT or "mark.slow" not in token.line:
                continue
            for name, items in _comment_references(path, token.string, collected).items():
                claims += 1
                where = f"{path.relative_to(TESTS)}:{token.start[0]} {name}"
                if not items:
                    unresolved.append(where)
                elif all(item.slow for item in items):
                    not_default.append(where)
    assert claims > 10, "no slow-marker comment names a test: is the comment style what this test expects?"
    assert not unresolved, "names no collected test:\n" + "\n".join(unresolved)
    assert not not_default, "named as covering the default run, but only --all runs it:\n" + "\n".join(not_default)


def test_the_checks_see_a_wrong_claim():
    items = [Item("integration/test_a.py", "test_fast", None, False),
             Item("integration/test_a.py", "test_big", "x", True), Item("multirank/test_b.py", "test_wide", "2", True)]
    assert _matches("test_a.py", items) == items[:2]
    assert _matches("test_a.py[x]", items) == [items[1]]
    assert _matches("multirank/test_b.py::test_wide[2]", items) == [items[2]]
    assert _matches("test_b.py", items) == []  # no folder: integration/
    assert _references("`test_a.py` (slow: big), `multirank/test_b.py`, `not a test`") == [
        ("test_a.py", " (slow: big), `multirank/test_b.py`, `not a test`"), ("multirank/test_b.py", ", `not a test`")]
    named = _comment_references(TESTS / "multirank" / "test_b.py", "# by default: test_wide, test_a.py[x], test_b",
                                items)
    assert named == {"test_wide": [items[2]], "test_a.py[x]": [items[1]], "test_b": [items[2]]}
