"""A fresh clone runs its tests with nothing beside it.

CI clones the repository next to a copy of the workplace's ``shared/`` folder, so a test that reads
``../shared/data`` passes there and fails for everyone else who clones dapo. These checks do not
trust the checkout they run in: the static one reads every test source for a path out of the
repository, the dynamic one copies what a clone holds into an empty folder and runs there the tests
that read data files (tests/data), plus the collection of the whole suite (module-level loads).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = "tests/data"
# A path out of the repository in a test source: the workplace's folder beside the clone (a
# relative "../shared"; Path(__file__).parents[N] above the root is PARENTS' case), or an absolute
# path into the machine the tests were written on. A tmp_path / "shared" folder is a test's own.
OUTSIDE = re.compile(r"""\.\./shared|["']\.\.["']\s*/\s*["']shared|/work/""")
PARENTS = re.compile(r"\.parents\[(\d+)\]")
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its patterns would match themselves


def _clone_paths() -> list[str]:
    """The files a clone of this checkout holds once its work is committed: tracked files and new
    files git does not ignore (the work tree's content, so that an uncommitted edit is checked too)."""
    if not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout: what a clone holds is unknown")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True, timeout=60).stdout.decode()
    return [p for p in out.split("\0") if p and (ROOT / p).is_file()]  # a deleted, uncommitted file: gone


def test_no_test_source_names_a_path_outside_the_repository():
    found = []
    for rel in _clone_paths():
        if not rel.startswith("tests/") or not rel.endswith(".py") or rel == SELF:
            continue
        depth_to_root = len(Path(rel).parts) - 1  # Path(__file__).parents[depth_to_root] is the repo root
        for lineno, line in enumerate((ROOT / rel).read_text(encoding="utf-8").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{rel}:{lineno}: {line.strip()}")
            found += [f"{rel}:{lineno}: parents[{n}] is above the repository: {line.strip()}"
                      for n in PARENTS.findall(line) if int(n) > depth_to_root]
    assert found == [], "tests must read only the repository (put data files in tests/data):\n" + "\n".join(found)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_data_tests_pass_in_a_copy_of_the_clone_with_nothing_beside_it(tmp_path):
    paths = _clone_paths()
    assert any(p.startswith(FIXTURES + "/") for p in paths), f"{FIXTURES} is not in the repository (git add it)"
    clone = tmp_path / "dapo"  # tmp_path holds nothing else: no ../shared, no ../anything
    for rel in paths:
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, clone / rel)
    # The tiny model cache is a build output (ignored by git), not data: linked so that the copy's
    # conftest does not spend minutes rebuilding it.
    (ROOT / ".cache").mkdir(exist_ok=True)
    (clone / ".cache").symlink_to(ROOT / ".cache", target_is_directory=True)
    readers = sorted(p for p in paths if p.startswith("tests/") and p.endswith(".py") and p != SELF
                     and '/ "data"' in (ROOT / p).read_text(encoding="utf-8"))
    assert {"tests/unit/test_data.py", "tests/unit/test_rewards.py"} <= set(readers), readers
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)  # the copy's own modules, not this checkout's
    pytest_cmd = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider"]
    collect = subprocess.run([*pytest_cmd, "-q", "--collect-only", "tests"], cwd=clone, env=env,
                             capture_output=True, text=True, timeout=300)
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-2000:]
    # The slow (engine) tests among them run in the full suite; their data paths are the same constants.
    run = subprocess.run([*pytest_cmd, "-m", "not slow", *readers], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\d+ passed", run.stdout) and " failed" not in run.stdout, run.stdout[-2000:]
    # The copy ran its own modules: the rootdir pytest reports is the copy.
    assert f"rootdir: {clone}" in run.stdout, run.stdout[:2000]
