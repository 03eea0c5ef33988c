"""The ``zinf`` command (zinf_compiler/cli.py): ``zinf plan`` and ``zinf inspect`` beside the ``python -m`` forms."""

import importlib.metadata

import pytest

from zinf_compiler import cli


def test_help_lists_the_commands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "zinf plan" not in out and "usage: zinf <command>" in out
    for command in ("plan", "inspect"):
        assert f"\n  {command} " in out, out


def test_no_command_or_an_unknown_one_is_a_usage_error(capsys):
    assert cli.main([]) == 2
    assert "commands:" in capsys.readouterr().out
    assert cli.main(["train"]) == 2
    err = capsys.readouterr().err
    assert "no command 'train'" in err and "plan" in err


@pytest.mark.parametrize("command", ["plan", "inspect"])
def test_each_command_is_its_module_under_the_zinf_name(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: zinf {command} ")


def test_inspect_of_a_missing_folder_says_so(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "error:" in capsys.readouterr().err


def test_the_installed_console_script_is_this_main():
    scripts = {entry.name: entry.value for entry in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("zinf") == "zinf_compiler.cli:main", "reinstall (pip install -e .) after pyproject changes"
