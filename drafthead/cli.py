"""The `drafthead` command line: one module per subcommand in drafthead/commands/.

Expected errors (bad input the user can fix) print one line, `drafthead: error: ...`, and exit 2,
without a traceback; set DRAFTHEAD_TRACEBACK=1 to see it anyway. A warning is one line too,
`drafthead: warning: ...`. Ctrl-C exits 130 and SIGTERM 143, each after the command's cleanup
(locks, temp files) has run. Under `accelerate launch` / `torchrun` the main process alone prints;
every process also writes its error line where the launcher's summary of a failed rank reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import os
import signal
import sys
import threading
import time
import warnings

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
    from .commands import launch_rank, parse_with_overrides

    with one_line_warnings(launch_rank() == 0):  # the parser and the command alike
        parser, modules = build_parser()
        args = parse_with_overrides(parser, argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return run_reporting(lambda: modules[args.command].run(args))


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so that the command's
    cleanup runs (output locks, temp files: ground/outdir.py) before the process exits."""


def run_reporting(run) -> int:
    """run() -> exit code, with an expected error as one line `drafthead: error: ...` and code 2
    (DRAFTHEAD_TRACEBACK=1: raised with its traceback), Ctrl-C as code 130 and SIGTERM as 143."""
    from .commands import launch_rank

    main = launch_rank() == 0
    with sigterm_raises():
        try:
            return int(run() or 0)
        except EXPECTED_ERRORS as e:
            if os.environ.get("DRAFTHEAD_TRACEBACK"):
                raise
            return report(f"drafthead: error: {one_line(e)}", 2, main)
        except KeyboardInterrupt:
            return report("drafthead: interrupted", 130, main)
        except Terminated:
            return report("drafthead: terminated", 143, main)


def report(line: str, code: int, main: bool) -> int:
    """Print `line` on the main process; under a launcher, every process also writes it to the
    error file torch's elastic agent reads (TORCHELASTIC_ERROR_FILE), whose summary of a failed
    rank then shows it. Returns `code`."""
    if main:
        print(line, file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
        with contextlib.suppress(OSError):  # the summary only loses the line
            with open(error_file, "w") as f:
                json.dump({"message": record}, f)
    return code


@contextlib.contextmanager
def one_line_warnings(main: bool):
    """Warnings as one line `drafthead: warning: ...` on the main process (not Python's
    file:line and source line), none on the others; as before after the block."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if main:
            print(f"drafthead: warning: {' '.join(str(message).split())}", file=sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises Terminated in the main thread during the block (a thread cannot set
    handlers: there it keeps its default); the previous handler after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
