"""The `drafthead` command line: one module per subcommand in drafthead/commands/.

Expected errors (bad input the user can fix) print one line, `drafthead: error: ...`, and exit 2,
without a traceback; set DRAFTHEAD_TRACEBACK=1 to see it anyway.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

# Subcommand modules under drafthead.commands; each exposes add_parser(subparsers) and run(args).
COMMANDS = ("generate", "bench", "serve", "demo", "export", "import", "train", "gate", "data")

# What counts as an expected error: our error classes derive from ValueError (TargetError,
# PromptError, DrafterError, PromptTooLong, config errors, OutputExistsError...), plus what the
# file system refuses (missing files, permissions, a full disk: OSError) and missing features.
EXPECTED_ERRORS = (ValueError, OSError, NotImplementedError)

# errno -> what to do about it, after the file and the system's words
OS_ERROR_HINTS = {
    errno.EACCES: "check its permissions, or write somewhere else",
    errno.EPERM: "check its permissions, or write somewhere else",
    errno.EROFS: "the file system is read-only: write somewhere else",
    errno.ENOSPC: "the disk is full: free space or write somewhere else",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="drafthead",
        description="Train draft heads on a frozen target LLM and run lossless speculative generation.",
    )
    parser.add_argument("--version", action="version", version=f"drafthead {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name in COMMANDS:
        # `import` is a Python keyword, so its module is import_
        module = importlib.import_module(f"drafthead.commands.{'import_' if name == 'import' else name}")
        module.add_parser(subparsers)
        modules[name] = module
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    from .commands import parse_with_overrides

    parser, modules = build_parser()
    args = parse_with_overrides(parser, argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return run_reporting(lambda: modules[args.command].run(args))


def run_reporting(run) -> int:
    """run() -> exit code, with an expected error as one line `drafthead: error: ...` and code 2
    (DRAFTHEAD_TRACEBACK=1: raised with its traceback), and Ctrl-C as code 130."""
    try:
        return int(run() or 0)
    except EXPECTED_ERRORS as e:
        if os.environ.get("DRAFTHEAD_TRACEBACK"):
            raise
        print(f"drafthead: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("drafthead: interrupted", file=sys.stderr)
        return 130


def one_line(e: BaseException) -> str:
    """The message on one line (argparse-style output has no room for multi-line text); an
    OSError names its file, then what to do (OS_ERROR_HINTS)."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        hint = OS_ERROR_HINTS.get(e.errno) if e.errno is not None else None
        text = f"{e.filename}: {e.strerror}" + (f"; {hint}" if hint else "")
    else:
        text = str(e)
    return " ".join(text.split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
