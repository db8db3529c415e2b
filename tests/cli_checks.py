"""Running the CLI in-process and holding a refusal to one clear line: what the reliability tests
and every test of a command's bad input check (docs/reliability.md)."""

from __future__ import annotations

from drafthead import cli


def run_cli(capsys, *argv) -> tuple[int, str]:
    """cli.main(argv) -> (exit code, stderr of this call alone)."""
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, *fragments: str) -> str:
    """Exit 2 and stderr exactly one `drafthead: error:` line holding every fragment (no note
    before it, no traceback, no warning)."""
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("drafthead: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def assert_failed_late(code: int, err: str, *fragments: str) -> str:
    """For a fault met mid-work (a disk that fills, a target that answers nothing), after the
    command's progress notes: exit 2, and the last stderr line is the only error line, holding
    every fragment; no traceback."""
    lines = err.splitlines()
    assert code == 2, err
    assert lines and "drafthead: error: " in lines[-1], err
    # "error:" (an error's own line, "ValueError: ..." too), not "error" (a tmp path may hold the word)
    assert sum("error:" in line.lower() for line in lines) == 1 and "Traceback" not in err, err
    # a progress bar the fault cut short leaves no newline before the error
    line = lines[-1][lines[-1].index("drafthead: error: ") :]
    for fragment in fragments:
        assert fragment in line, line
    return line
