"""docs/options.md cannot drift from the options table (zinf_compiler/options.py's OPTION_SPECS): its summary
is generated from it (scripts/options_doc.py), and its detailed table names every option, and no other."""

import importlib.util
import pathlib
import re

from zinf_compiler.options import OPTION_SPECS

REPO = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("options_doc", REPO / "scripts" / "options_doc.py")
options_doc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(options_doc)


def detailed_names(text: str) -> set[str]:
    """The option names the first column of the page's "In detail" table gives ("a, b" and "a / b" name two)."""
    table = text.split("## In detail", 1)[1]
    names = set()
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("name", "") or set(cells[0]) <= set("-"):
            continue
        names.update(part for part in re.split(r"\s*[,/]\s*", cells[0]) if part)
    return names


def test_the_summary_is_the_generated_one():
    text = options_doc.PAGE.read_text()
    assert options_doc.generated_page(text) == text, "docs/options.md is out of date: python scripts/options_doc.py"


def test_the_detailed_table_names_every_option_and_no_other():
    names = detailed_names(options_doc.PAGE.read_text())
    known = {spec.name for spec in OPTION_SPECS}
    assert names - known == set(), f"docs/options.md describes options that do not exist: {sorted(names - known)}"
    assert known - names == set(), f"docs/options.md does not describe: {sorted(known - names)}"


def test_the_checks_see_a_stale_summary_and_a_missing_option():
    text = options_doc.PAGE.read_text()
    stale = text.replace("| `stage` | `3` |", "| `stage` | `2` |")
    assert options_doc.generated_page(stale) == text != stale
    missing = re.sub(r"(?m)^\| ram_cache_bytes \|.*\n", "", text)
    assert "ram_cache_bytes" not in detailed_names(missing) and "stage" in detailed_names(missing)
