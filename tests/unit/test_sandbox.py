"""The sandbox (actors/sandbox.py) stops what model-written code must not do, each within its limit."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from actors.sandbox import Limits, run_python

FAST = Limits(cpu_s=1, wall_s=3.0, memory_mb=256, output_bytes=4096)


def test_code_runs_reads_stdin_and_writes_inside_its_directory():
    r = run_python("import os, sys\nopen('f.txt', 'w').write(sys.stdin.read() * 2)\n"
                   "print(open('f.txt').read(), os.getcwd() == os.environ['HOME'])", stdin="ab", limits=FAST)
    assert (r.returncode, r.stdout, r.stopped_by, r.ok) == (0, "abab True\n", "", True), r.stderr


def test_an_infinite_loop_is_stopped_by_its_cpu_limit():
    # A wall deadline far beyond the CPU limit: on a loaded machine (CI's two xdist workers on two
    # cores) the loop gets a fraction of a core, and 1 s of CPU took over 3 s of wall time.
    r = run_python("while True:\n    pass\n", limits=Limits(cpu_s=1, wall_s=60.0, memory_mb=256))
    assert (r.stopped_by, r.ok) == ("cpu", False)


def test_sleeping_code_is_stopped_by_the_wall_deadline():
    start = time.monotonic()
    r = run_python("import time\ntime.sleep(60)\n", limits=Limits(cpu_s=1, wall_s=1.0))
    assert r.stopped_by == "wall" and time.monotonic() - start < 5


def test_a_fork_bomb_starts_no_process(tmp_path):
    marker = tmp_path / "forked"
    r = run_python(f"import os\nwhile True:\n    if os.fork() == 0:\n        open({str(marker)!r}, 'w')\n", limits=FAST)
    assert r.returncode != 0 and "PermissionError: sandbox: os.fork is not allowed" in r.stderr
    r = run_python("import subprocess\nsubprocess.run(['true'])\n", limits=FAST)
    assert "PermissionError: sandbox: subprocess.Popen is not allowed" in r.stderr
    assert not marker.exists()


def test_a_memory_bomb_gets_memory_error_within_its_address_space():
    r = run_python("x = bytearray(1 << 30)\n", limits=FAST)
    assert r.stopped_by == "memory" and "MemoryError" in r.stderr


def test_a_flood_of_output_is_cut_and_the_process_killed():
    r = run_python("while True:\n    print('x' * 1000)\n", limits=FAST)
    assert r.stopped_by == "output" and len(r.stdout) <= FAST.output_bytes


def test_no_network_connection_reaches_a_listening_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted = []

    def accept():
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            try:
                accepted.append(server.accept())
            except socket.timeout:
                continue

    thread = threading.Thread(target=accept)
    thread.start()
    port = server.getsockname()[1]
    r = run_python(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')\n",
                   limits=FAST)
    thread.join()
    server.close()
    assert "connected" not in r.stdout and r.returncode != 0 and not accepted
    assert "PermissionError: sandbox: socket" in r.stderr
    if os.geteuid() == 0:
        assert r.isolated_network  # the kernel layer too: a network namespace of its own


def test_writes_outside_its_directory_are_refused(tmp_path):
    target = tmp_path / "outside.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')", f"import os\nos.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)",
                 f"import os\nos.rename('main.py', {str(target)!r})", f"import shutil\nshutil.rmtree({str(tmp_path)!r})"):
        r = run_python(code, limits=FAST)
        assert r.returncode != 0 and "PermissionError: sandbox:" in r.stderr, (code, r.stderr)
    assert not target.exists() and tmp_path.exists()


def test_ctypes_cannot_be_used_to_get_around_the_hook():
    r = run_python("import ctypes\nctypes.CDLL(None).fork()\n", limits=FAST)
    assert r.returncode != 0 and "PermissionError: sandbox: " in r.stderr


@pytest.mark.parametrize("bad", ["raise SystemExit(3)", "1/0", "import no_such_module"])
def test_failures_are_results_not_exceptions(bad):
    r = run_python(bad, limits=FAST)
    assert r.returncode != 0 and not r.ok


def test_unit_tests_env_scores_the_last_code_block_and_the_python_tool_answers_calls(monkeypatch):
    from actors import code_env
    from actors.code_env import PythonTool, UnitTests
    from dapo import code_task
    from dapo.envs import Episode

    tests = code_task.tests_of("add_n", 7)
    right = "Here:\n```python\ndef add_n(x):\n    return x + 6\n```\nFixed:\n```python\ndef add_n(x):\n    return x + 7\n```"
    env = UnitTests()
    assert env.step(Episode("code_tests", tests, (right,))).reward == 1.0
    wrong = right.replace("x + 7", "x - 7")
    assert (env.step(Episode("code_tests", tests, (wrong,))).reward, env.step(Episode("code_tests", tests, ("no code",))).acc) == (-1.0, False)
    call = PythonTool().step(Episode("code_tests", tests, ("<python>print(6 * 7)</python>",), ended_by="stop"))
    assert (call.observation, call.tool_call, call.tool_failed, call.done) == ("<output>42\n</output>", True, False, False)
    # The tool's CPU limit with a wall deadline a loaded machine cannot reach first (see above).
    monkeypatch.setattr(code_env, "TOOL_LIMITS", Limits(cpu_s=code_env.TOOL_LIMITS.cpu_s, wall_s=60.0, memory_mb=512))
    loop = PythonTool().step(Episode("code_tests", tests, ("<python>while True: pass</python>",), ended_by="stop"))
    assert (loop.observation, loop.tool_failed) == ("<output>error: cpu</output>", True)


@pytest.mark.timeout(120)
def test_the_actors_env_workers_survive_every_bomb_and_keep_answering(tmp_path):
    from actors.env_pool import EnvPool
    from dapo.envs import Episode

    bombs = ["while True: pass", "import os\nwhile True: os.fork()", "x = bytearray(1 << 34)",
             "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)",
             f"open({str(tmp_path / 'out')!r}, 'w')", "while True: print('x' * 1000)", "print(1 + 1)"]
    pool = EnvPool(2, 30.0)
    try:
        for i, code in enumerate(bombs):
            pool.submit(i, "actors.code_env:PythonTool", Episode("code_tests", "", (f"<python>{code}</python>",),
                                                                 ended_by="stop"))
        answers = {}
        while pool.pending:
            answers.update((a.key, a) for a in pool.poll(30.0))
        assert [answers[i].step.tool_failed for i in range(len(bombs))] == [True] * 6 + [False]
        assert answers[6].step.observation == "<output>2\n</output>" and pool.num_errors == 0
        assert not (tmp_path / "out").exists()
    finally:
        pool.close()
