"""The ``zinf`` command: ``zinf plan ...`` and ``zinf inspect ...``.

The same programs as ``python -m zinf_compiler.plan_cli`` (what a model needs under each option set,
before any run, or the options zinf chooses for a memory budget) and ``python -m zinf_compiler.inspect``
(a dump folder's summary); ``zinf <command> --help`` lists each one's arguments.
"""

from __future__ import annotations

import sys

from . import inspect, plan_cli

COMMANDS = {
    "plan": (plan_cli.main, "what a model needs under each option set, or the options for a memory budget"),
    "inspect": (inspect.main, "summarise a dump folder (options={'dump_dir': ...}), or print one graph file"),
}


def usage() -> str:
    """The help text: the commands and what each does."""
    width = max(map(len, COMMANDS))
    lines = ["usage: zinf <command> [arguments]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "zinf <command> --help: that command's arguments"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: the process's arguments); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"zinf: no command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    run, _ = COMMANDS[command]
    return run(rest, prog=f"zinf {command}")


if __name__ == "__main__":
    sys.exit(main())
