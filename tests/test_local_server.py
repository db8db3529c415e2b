"""Local servers (inference/servers/local.py), with a stand-in server made of the standard library:
up inside the block, stopped after it, one line when it cannot start, and gone when the process
that started it is killed with SIGKILL."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from drafthead.inference.servers.local import ServerStartError, healthy, local_server

pytestmark = pytest.mark.subprocess  # starts processes of its own (pyproject.toml markers)

HEALTH_SERVER = textwrap.dedent("""
    import http.server, sys
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is gone too
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "health.py"
    path.write_text(HEALTH_SERVER)
    return path


def test_up_inside_the_block_and_stopped_after(script):
    with local_server(lambda port: [sys.executable, script, port], "stand-in") as url:
        assert healthy(url)
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            assert response.status == 200
    assert not healthy(url)


def test_a_server_that_exits_or_never_answers_is_one_line(tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError, match=r"stand-in did not come up on http://127\.0\.0\.1:\d+ .*rc 3; log: "):
        with local_server(lambda port: [sys.executable, "-c", "import sys; sys.exit(3)"], "stand-in", log=log):
            pass
    with pytest.raises(ServerStartError, match=r"within 1 s \(rc None"):
        with local_server(lambda port: [sys.executable, "-c", "import time; time.sleep(60)"], "stand-in", ready_within=1):
            pass


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's prctl")
def test_the_server_dies_with_a_killed_parent(script, tmp_path):
    pid_file = tmp_path / "server.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import subprocess, sys, time
        from pathlib import Path
        from drafthead.inference.servers import local
        started = []
        popen = subprocess.Popen
        def recording(*args, **kwargs):
            started.append(popen(*args, **kwargs))
            return started[-1]
        local.subprocess.Popen = recording
        with local.local_server(lambda port: [sys.executable, {str(script)!r}, port], "stand-in"):
            Path({str(pid_file)!r}).write_text(str(started[0].pid))
            time.sleep(120)
    """),
        ]
    )
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    server = int(pid_file.read_text())
    assert not gone(server, within=0.5)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert gone(server)
