"""The sandbox (actors/sandbox.py) runs code within its limits, and the code environments that use it.

What model code must not be able to do (get out, read secrets, cheat its reward) is attacked in
tests/chaos/test_sandbox_escapes.py, each verdict taken from outside the sandbox."""

from __future__ import annotations

import json
import time

import pytest

from actors import sandbox
from actors.sandbox import Limits, run_python

FAST = Limits(cpu_s=1, wall_s=20.0, memory_mb=256, output_bytes=4096)  # the wall: far beyond a loaded CI's start-up


def test_code_runs_reads_stdin_and_writes_inside_its_directory():
    r = run_python("import os, sys\nopen('f.txt', 'w').write(sys.stdin.read() * 2)\n"
                   "print(open('f.txt').read(), os.getcwd() == os.environ['HOME'], sorted(os.environ))",
                   stdin="ab", limits=FAST)
    assert (r.returncode, r.stopped_by, r.ok, r.isolated) == (0, "", True, True), r.stderr
    # None of this process's environment: only what the sandbox sets (and Python's own LC_CTYPE).
    assert r.stdout == ("abab True ['HOME', 'LC_CTYPE', 'PATH', 'PWD', 'PYTHONDONTWRITEBYTECODE', 'PYTHONHASHSEED', "
                        "'TMPDIR']\n")


def test_the_standard_library_and_subprocesses_work_and_installed_packages_are_hidden():
    r = run_python("import subprocess\nprint(subprocess.run(['echo', 'hi'], capture_output=True, text=True).stdout, end='')\n"
                   "for name in ('numpy', 'torch', 'dapo', 'actors'):\n    try:\n        __import__(name)\n"
                   "    except ImportError:\n        print('no', name)\n", limits=FAST)
    assert r.stdout == "hi\nno numpy\nno torch\nno dapo\nno actors\n", r.stderr


def test_an_infinite_loop_is_stopped_by_its_cpu_limit():
    # A wall deadline far beyond the CPU limit: on a loaded machine (CI's two xdist workers on two
    # cores) the loop gets a fraction of a core, and 1 s of CPU took over 3 s of wall time.
    r = run_python("while True:\n    pass\n", limits=Limits(cpu_s=1, wall_s=60.0, memory_mb=256))
    assert (r.stopped_by, r.ok) == ("cpu", False)


def test_sleeping_code_is_stopped_by_the_wall_deadline():
    start = time.monotonic()
    r = run_python("import time\ntime.sleep(60)\n", limits=Limits(cpu_s=1, wall_s=1.0))
    assert r.stopped_by == "wall" and time.monotonic() - start < 5


def test_code_that_closes_its_output_and_sleeps_is_stopped_at_the_wall_deadline():
    start = time.monotonic()
    r = run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)\n", limits=Limits(cpu_s=1, wall_s=1.0))
    assert r.stopped_by == "wall" and time.monotonic() - start < 5


def test_a_memory_bomb_gets_memory_error_within_its_address_space():
    r = run_python("x = bytearray(1 << 30)\n", limits=FAST)
    assert r.stopped_by == "memory" and "MemoryError" in r.stderr


def test_a_flood_of_output_is_cut_and_the_process_killed():
    r = run_python("while True:\n    print('x' * 1000)\n", limits=FAST)
    assert r.stopped_by == "output" and len(r.stdout) <= FAST.output_bytes


def test_writes_beyond_its_disk_cap_fail_with_no_space():
    r = run_python("import os\nfor i in range(64):\n    open(f'f{i}', 'wb').write(bytes(1 << 20))\n",
                   limits=Limits(cpu_s=2, wall_s=10.0, disk_mb=8))
    assert r.returncode != 0 and "No space left on device" in r.stderr


@pytest.mark.parametrize("bad", ["raise SystemExit(3)", "1/0", "import no_such_module"])
def test_failures_are_results_not_exceptions(bad):
    r = run_python(bad, limits=FAST)
    assert r.returncode != 0 and not r.ok


def test_without_bwrap_code_environments_refuse_to_start_with_the_fix(monkeypatch):
    from actors.code_env import PythonTool, UnitTests

    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.isolation_problem.cache_clear()
    try:
        for env in (PythonTool, UnitTests):
            with pytest.raises(sandbox.SandboxUnavailable, match=r"^model-written code needs bubblewrap, which is not "
                               r"installed: apt-get install bubblewrap .*or set actor.sandbox=none"):
                env()
        with pytest.raises(sandbox.SandboxUnavailable):
            run_python("print(1)")
    finally:
        sandbox.isolation_problem.cache_clear()


def test_sandbox_none_runs_unisolated_and_says_so(caplog):
    try:
        sandbox.set_isolation("none")
        assert "WITHOUT isolation" in caplog.text
        r = run_python("import os\nprint(os.environ.get('HOME') == os.getcwd())", limits=FAST)
        assert (r.stdout, r.isolated) == ("True\n", False)
    finally:
        sandbox.set_isolation("bwrap")
    with pytest.raises(ValueError, match="expected one of"):
        sandbox.set_isolation("nsjail")


RIGHT = "Here:\n```python\ndef add_n(x):\n    return x + 6\n```\nFixed:\n```python\ndef add_n(x):\n    return x + 7\n```"


def test_unit_tests_env_scores_the_last_code_block_and_the_python_tool_answers_calls(monkeypatch):
    from actors import code_env
    from actors.code_env import PythonTool, UnitTests
    from dapo.tasks import coding
    from dapo.envs import Episode

    tests = coding.tests_of("add_n", 7)
    env = UnitTests()
    assert env.step(Episode("code_tests", tests, (RIGHT,))).reward == 1.0
    wrong = RIGHT.replace("x + 7", "x - 7")
    assert (env.step(Episode("code_tests", tests, (wrong,))).reward, env.step(Episode("code_tests", tests, ("no code",))).acc) == (-1.0, False)
    call = PythonTool().step(Episode("code_tests", tests, ("<python>print(6 * 7)</python>",), ended_by="stop"))
    assert (call.observation, call.tool_call, call.tool_failed, call.done) == ("<output>42\n</output>", True, False, False)
    # The tool's CPU limit with a wall deadline a loaded machine cannot reach first (see above).
    monkeypatch.setattr(code_env, "TOOL_LIMITS", Limits(cpu_s=code_env.TOOL_LIMITS.cpu_s, wall_s=60.0, memory_mb=512))
    loop = PythonTool().step(Episode("code_tests", tests, ("<python>while True: pass</python>",), ended_by="stop"))
    assert (loop.observation, loop.tool_failed) == ("<output>error: cpu</output>", True)


@pytest.mark.parametrize("answer, expected", [
    ("def f(x):\n    return x % 2 == 0", (True, "")),
    ("def f(x):\n    return int(x % 2 == 0)", (False, "wrong answer")),  # 1 is not True
    ("def f(x):\n    print('thinking', x)\n    return x % 2 == 0", (True, "")),  # its prints go to stderr
    ("def f(x):\n    return {'even': x % 2 == 0}", (False, "wrong answer")),
    ("def f(x):\n    raise ValueError(x)", (False, "raised ValueError")),
    ("def g(x):\n    return True", (False, "raised KeyError while loading the answer")),
    ("def f(x):\n    return float('nan')", (False, "raised ValueError")),  # not JSON
])
def test_grading_compares_plain_json_values_of_the_same_type(answer, expected):
    from actors.code_env import grade

    truth = json.dumps({"function": "f", "tests": [{"args": [4], "expected": True}, {"args": [3], "expected": False}]})
    assert grade(answer, truth) == expected


@pytest.mark.parametrize("truth", ["assert f(1) == 2", '{"function": "f", "tests": []}',
                                   '{"function": "1f", "tests": [{"args": [1], "expected": 2}]}',
                                   '{"function": "f", "tests": [{"args": 1, "expected": 2}]}'])
def test_a_malformed_ground_truth_says_how_tests_are_written(truth):
    from actors.code_env import parse_tests

    with pytest.raises(ValueError, match=r'a code_tests ground truth .*\{"function": "add_n", "tests": \[\{"args": \[0\]'):
        parse_tests(truth)


@pytest.mark.timeout(120)
def test_the_actors_env_workers_survive_every_bomb_and_keep_answering():
    from actors.env_pool import EnvPool
    from dapo.envs import Episode

    bombs = ["while True: pass", "import os\nwhile True: os.fork()", "x = bytearray(1 << 34)",
             "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)",
             "open('/usr/x', 'w')", "while True: print('x' * 1000)", "print(1 + 1)"]
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
    finally:
        pool.close()
