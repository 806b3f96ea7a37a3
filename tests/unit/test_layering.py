"""The dependency rule and the no-pickle rule, checked on the source with `ast`.

- ``dapo`` is the pure library: no inference engine, network, process or collective code, and no
  imports of the services (dapo/heap.py alone may call glibc's allocator through ctypes). ``actors`` and ``learner`` import ``dapo`` and ``protos``, never each other.
- ``dapo/launch/`` (dapo run, dapo learner, dapo sweep) is the one part of ``dapo`` that may start,
  signal and kill processes and reserve ports (subprocess, socket, signal, psutil, ctypes, os
  process calls); it starts the services as commands and never imports them (no actors, learner,
  torch, vllm, grpc or zmq). No other module of ``dapo`` imports ``dapo.launch``; ``dapo/cli.py``
  may only replace itself (os.exec*) with a launcher or service command, which starts no child.
- Nothing under dapo/ actors/ learner/ protos/ unpickles: network data and checkpoints are
  parsed, never executed.
- One home per concern: the gRPC channel is opened only by the one client (actors/client.py),
  the auth metadata key is spelled only in protos/__init__.py, the staleness bound k is
  stored only by learner/admission.py, and kernel socket deadlines (SO_RCVTIMEO/SO_SNDTIMEO) are
  set only by protos/transports.py (both ends of the weight side channel use it).
- No import cycles among the modules of ``dapo``: a module imports only modules below it. An import
  inside a function counts too (deferring it hides the circle from Python, not from a reader).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dapo", "actors", "learner", "protos")

FORBIDDEN = {
    "dapo": ("vllm", "grpc", "zmq", "torch.distributed", "actors", "learner", "subprocess", "socket",
             "multiprocessing", "signal", "psutil", "ctypes", "dapo.launch"),
    "dapo/launch": ("actors", "learner", "torch", "vllm", "grpc", "zmq", "multiprocessing"),
    "actors": ("learner",),
    "learner": ("actors",),
    "protos": ("actors", "learner"),
}
HOMES = {"channel": "actors/client.py", "x-dapo-token": "protos/__init__.py",
         "max_staleness_steps": "learner/admission.py", "SO_RCVTIMEO": "protos/transports.py"}
"""Concern -> the one product file allowed to hold it (see ``home_violations``)."""
PICKLERS = ("pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib")
# os functions that start, signal or regroup processes: dapo/launch/ only. os.exec* replaces the
# current process (no child), which the `dapo` CLI dispatcher does on purpose, so it is allowed there.
PROCESS_CALLS = ("fork", "forkpty", "system", "popen", "spawn", "posix_spawn", "exec", "kill", "setsid",
                 "setpgid", "wait")
EXEC_ALLOWED = {("dapo/cli.py", "execvpe")}
IMPORT_ALLOWED = {("dapo/heap.py", "ctypes")}
"""(file, banned module) pairs allowed anyway: dapo/heap.py calls glibc's allocator (malloc_trim,
mallinfo2) for the learner and the actors alike, and nothing else of ctypes."""


def sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    assert any(p.parts[-3:] == ("dapo", "config", "__init__.py") for p in files)  # the walk found the tree
    return sorted(files)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def imported_modules(tree: ast.AST, path: str) -> list[tuple[int, str]]:
    """(line, dotted module) for every import, relative ones resolved; ``from a import b``
    yields both ``a`` and ``a.b`` (b may be a submodule: ``from torch import distributed``)."""
    package = path.rsplit("/", 1)[0].replace("/", ".")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and _call_name(node) in ("import_module", "__import__")):
            out.append((node.lineno, node.args[0].value))
    return out


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def matches(module: str, banned: str) -> bool:
    return module == banned or module.startswith(banned + ".")


def layering_violations(source: str, path: str) -> list[str]:
    top = "dapo/launch" if path.startswith("dapo/launch/") else path.split("/", 1)[0]
    tree = ast.parse(source, filename=path)
    out = [f"{path}:{line} imports {mod} (forbidden in {top}/)"
           for line, mod in imported_modules(tree, path)
           for banned in FORBIDDEN.get(top, ()) if matches(mod, banned) and (path, banned) not in IMPORT_ALLOWED]
    if top == "dapo":
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"
                    and node.func.attr.startswith(PROCESS_CALLS)
                    and (path, node.func.attr) not in EXEC_ALLOWED):
                out.append(f"{path}:{node.lineno} calls os.{node.func.attr} (only dapo/launch/ handles processes)")
    return out


def home_violations(source: str, path: str) -> list[str]:
    """A gRPC channel opened, the auth metadata key spelled, an attribute ``max_staleness_steps``
    stored (``self.x = ...`` or a class field) in learner/, or a kernel socket deadline set,
    outside its home (HOMES)."""
    out = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if (isinstance(node, ast.Call) and _call_name(node) in ("insecure_channel", "secure_channel")
                and path != HOMES["channel"]):
            out.append(f"{path}:{node.lineno} opens a gRPC channel (use actors.client.CoordinatorClient)")
        if isinstance(node, ast.Constant) and node.value == "x-dapo-token" and path != HOMES["x-dapo-token"]:
            out.append(f"{path}:{node.lineno} spells the auth metadata key (use protos.AUTH_METADATA_KEY)")
        if (isinstance(node, ast.Attribute) and node.attr in ("SO_RCVTIMEO", "SO_SNDTIMEO")
                and path != HOMES["SO_RCVTIMEO"]):
            out.append(f"{path}:{node.lineno} sets a kernel socket deadline (use protos.transports.set_kernel_timeouts)")
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            name = t.attr if isinstance(t, ast.Attribute) else t.id if isinstance(t, ast.Name) else ""
            if (name == "max_staleness_steps" and path.startswith("learner/") and path != HOMES["max_staleness_steps"]
                    and (isinstance(t, ast.Attribute) or isinstance(node, ast.AnnAssign))):
                out.append(f"{path}:{node.lineno} stores k (read it from learner.admission.Admission)")
    return out


def pickle_violations(source: str, path: str) -> list[str]:
    tree = ast.parse(source, filename=path)
    out = [f"{path}:{line} imports {mod}" for line, mod in imported_modules(tree, path)
           for banned in PICKLERS if matches(mod, banned)]
    torch_loads = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and n.module == "torch" for a in n.names if a.name == "load"}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Call, ast.Attribute)):
            continue
        if isinstance(node, ast.Attribute):
            if node.attr in ("recv_pyobj", "send_pyobj", "read_pickle", "to_pickle"):
                out.append(f"{path}:{node.lineno} uses .{node.attr} (pickle)")
            continue
        kw = {k.arg: k.value for k in node.keywords}
        if "allow_pickle" in kw and not (isinstance(kw["allow_pickle"], ast.Constant)
                                         and kw["allow_pickle"].value is False):
            out.append(f"{path}:{node.lineno} passes allow_pickle")
        f = node.func
        is_torch_load = ((isinstance(f, ast.Attribute) and f.attr == "load" and isinstance(f.value, ast.Name)
                          and f.value.id == "torch") or (isinstance(f, ast.Name) and f.id in torch_loads))
        safe = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
        if is_torch_load and not safe:
            out.append(f"{path}:{node.lineno} calls torch.load without weights_only=True")
    return out


def module_name(path: str) -> str:
    """``dapo/launch/__init__.py`` -> ``dapo.launch``; ``dapo/models/tiny.py`` -> ``dapo.models.tiny``."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles(files: dict[str, str]) -> list[str]:
    """One line per import that closes a circle among ``files`` (path -> source): each strongly
    connected component of the import graph (Tarjan) with more than one module, with its imports."""
    modules = {module_name(path): path for path in files}
    edges = {m: sorted({(mod, line) for line, mod in imported_modules(ast.parse(files[p], filename=p), p)
                        if mod in modules and mod != m}) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for dep, _ in edges[m]:
            if dep not in index:
                visit(dep)
                low[m] = min(low[m], low[dep])
            elif dep in stack:
                low[m] = min(low[m], index[dep])
        if low[m] == index[m]:
            component = []
            while not component or component[-1] != m:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(set(component))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return [f"{modules[m]}:{line} imports {dep} (a circle: {' <-> '.join(sorted(c))})"
            for c in components for m in sorted(c) for dep, line in edges[m] if dep in c]


def test_dependency_rule():
    problems = [v for p in sources() for v in layering_violations(p.read_text(), rel(p))]
    assert not problems, "\n".join(problems)


def test_no_import_cycles_in_dapo():
    files = {rel(p): p.read_text() for p in sources() if rel(p).startswith("dapo/")}
    problems = import_cycles(files)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("files,cycle", [
    ({"dapo/a.py": "from dapo import b", "dapo/b.py": "def f():\n    import dapo.a"}, {"dapo.a", "dapo.b"}),
    ({"dapo/a.py": "from dapo.b import x", "dapo/b.py": "from .c import y", "dapo/c.py": "import dapo.a",
      "dapo/d.py": "import dapo.a"}, {"dapo.a", "dapo.b", "dapo.c"}),
    ({"dapo/launch/__init__.py": "from dapo import tiny", "dapo/tiny.py": "from dapo.launch import spawn"},
     {"dapo.launch", "dapo.tiny"}),
    ({"dapo/a.py": "from dapo import b", "dapo/b.py": "import os\nfrom dapo import c", "dapo/c.py": ""}, set()),
])
def test_import_cycle_checker(files, cycle):
    found = import_cycles(files)
    assert {m for line in found for m in line.split("(a circle: ")[1].rstrip(")").split(" <-> ")} == cycle, found
    assert len(found) == (len(cycle) if cycle else 0), found  # one import per module of the circle here


def test_one_home_per_concern():
    problems = [v for p in sources() for v in home_violations(p.read_text(), rel(p))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path,source,flagged", [
    ("actors/transports/network.py", "import grpc\ngrpc.insecure_channel(t)", True),
    ("actors/client.py", "import grpc\ngrpc.insecure_channel(t)", False),
    ("learner/x.py", "from grpc import secure_channel\nsecure_channel(t, c)", True),
    ("actors/x.py", "md = (('x-dapo-token', token),)", True),
    ("protos/__init__.py", "AUTH_METADATA_KEY = 'x-dapo-token'", False),
    ("learner/replay.py", "class B:\n    def __init__(self, k):\n        self.max_staleness_steps = k", True),
    ("learner/x.py", "class C:\n    max_staleness_steps: int", True),
    ("learner/admission.py", "class Admission:\n    max_staleness_steps: int", False),
    ("learner/x.py", "k = cfg.algorithm.max_staleness_steps", False),  # reading it is fine
    ("actors/transports/x.py", "import socket\ns.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)", True),
    ("learner/transports/x.py", "from socket import SOL_SOCKET\nimport socket as so\nso.SO_SNDTIMEO", True),
    ("protos/transports.py", "import socket\ns.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)", False),
])
def test_home_checker(path, source, flagged):
    assert bool(home_violations(source, path)) == flagged


def test_no_pickle_on_any_path():
    problems = [v for p in sources() for v in pickle_violations(p.read_text(), rel(p))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path,source", [
    ("dapo/x.py", "import torch.distributed as dist"),
    ("dapo/x.py", "from torch import distributed"),
    ("dapo/x.py", "from torch.distributed import all_reduce"),
    ("dapo/x.py", "import vllm"),
    ("dapo/x.py", "from vllm.sampling_params import SamplingParams"),
    ("dapo/x.py", "import grpc.aio"),
    ("dapo/x.py", "import zmq"),
    ("dapo/x.py", "import subprocess"),
    ("dapo/x.py", "from multiprocessing import Process"),
    ("dapo/x.py", "import socket"),
    ("dapo/x.py", "from learner.replay import ReplayBuffer"),
    ("dapo/sub/x.py", "from ...actors import loop"),
    ("dapo/x.py", "import importlib\nimportlib.import_module('vllm')"),
    ("dapo/x.py", "def f():\n    import zmq"),
    ("dapo/x.py", "import os\nos.system('ls')"),
    ("dapo/x.py", "import os\nos.fork()"),
    ("dapo/x.py", "import os\nos.execvpe('a', [], {})"),  # exec allowed in dapo/cli.py only
    ("dapo/plots.py", "import signal"),
    ("dapo/x.py", "import psutil"),
    ("dapo/runtime.py", "import ctypes"),
    ("dapo/x.py", "import os\nos.killpg(pid, 9)"),
    ("dapo/x.py", "import os\nos.setsid()"),
    ("dapo/cli.py", "from dapo.launch import run"),
    ("dapo/x.py", "from .launch import spawn"),
    ("dapo/launch/run.py", "import torch"),
    ("dapo/launch/x.py", "from learner.main import read_config"),
    ("dapo/launch/x.py", "import actors.main"),
    ("dapo/launch/x.py", "def f():\n    import zmq"),
    ("dapo/launch/x.py", "from grpc import server"),
    ("dapo/launch/x.py", "import vllm"),
    ("actors/x.py", "from learner import coordinator"),
    ("actors/engines/x.py", "from ...learner.publisher import x"),
    ("learner/x.py", "import actors.transports.network"),
    ("learner/transports/x.py", "from actors.transports import base"),
    ("actors/transports/x.py", "from learner.transports.collective import CollectiveSender"),
    ("protos/x.py", "from actors.client import CoordinatorClient"),
])
def test_layering_checker_flags(path, source):
    assert layering_violations(source, path)


@pytest.mark.parametrize("path,source", [
    ("dapo/x.py", "import torch\nfrom dapo.config import load_config"),
    ("dapo/x.py", "import grpcio_tools_like_name"),  # a prefix is not the package
    ("dapo/cli.py", "import os\nos.execvpe('a', [], {})"),
    ("dapo/heap.py", "import ctypes\nimport ctypes.util"),
    ("dapo/launch/x.py", "import os, signal, socket, subprocess, psutil, ctypes\nos.killpg(1, 9)\nos.setsid()\n"
                         "from dapo.launch import spawn\nfrom dapo.config import load_config"),
    ("learner/main.py", "from dapo.launch import die_with_parent"),  # a service may use the helpers
    ("actors/x.py", "import zmq\nimport grpc\nfrom protos import coordinator_pb2\nfrom dapo import wire"),
    ("learner/x.py", "import torch.distributed as dist\nfrom . import replay"),
])
def test_layering_checker_allows(path, source):
    assert layering_violations(source, path) == []


@pytest.mark.parametrize("source", [
    "import pickle",
    "import cloudpickle as cp",
    "from dill import loads",
    "import torch\ntorch.load(f)",
    "import torch\ntorch.load(f, weights_only=False)",
    "from torch import load\nload(f)",
    "import numpy as np\nnp.load(f, allow_pickle=True)",
    "sock.recv_pyobj()",
    "sock.send_pyobj(x)",
])
def test_pickle_checker_flags(source):
    assert pickle_violations(source, "learner/x.py")


@pytest.mark.parametrize("source", [
    "import torch\ntorch.load(f, weights_only=True, map_location='cpu')",
    "import numpy as np\nnp.load(f)",
    "import msgpack\nmsgpack.unpackb(b)",
    '"""Never pickle network data (recv_pyobj would)."""',  # prose is not code
])
def test_pickle_checker_allows(source):
    assert pickle_violations(source, "learner/x.py") == []
