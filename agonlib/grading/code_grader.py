r"""Code grader: run the last fenced Python block against stdin/stdout tests.

``grade_code`` scores 1 only if the program passes every test (at most
``max_tests``, longest inputs first), 0 otherwise; it never raises::

    >>> grade_code("```python\nprint(int(input()) * 2)\n```",
    ...            [{"input": "21\n", "output": "42\n"}])
    1
    >>> grade_code("no code here", [{"input": "", "output": ""}])
    0

Each test runs in a fresh process tree: a small launcher (``python -I -S``)
sets up the isolation, then execs ``python -I solution.py`` with cwd in its own
temp dir, a minimal environment (no secrets of the parent), resource limits
(CPU, address space, file size, processes, open files, no core files), its own
session killed with SIGKILL on a wall-clock deadline, and stdout/stderr read
incrementally and capped. Where the machine allows it (root, as here and in CI),
the launcher also

- unshares the network (only a loopback that is down), pid, mount, IPC and UTS
  namespaces; the program is pid 1 of its pid namespace, so when it exits or is
  killed the kernel kills every process it left behind, even ones that called
  ``setsid`` (``killpg`` alone would miss those);
- mounts a private tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``
  and a fresh ``/proc`` (no host processes, no ``/proc/<pid>/environ``);
- drops to a fresh unprivileged uid per run (``PR_SET_NO_NEW_PRIVS`` too), so
  ``RLIMIT_NPROC`` really caps a fork bomb (it does not apply to root), the
  parent cannot be signalled and root-owned files cannot be written. When the
  interpreter lives under an untraversable directory (``/root/.pyenv``), that
  directory is replaced by a tmpfs holding only the interpreter's prefix.

The first grade probes, strongest first, which of these works and records the
result in ``PROTECTIONS``; a weaker level logs a warning. Remaining risks, even
at full strength: the host filesystem stays readable wherever it is
world-readable, and world-writable directories other than the four above stay
writable; there is no seccomp filter and no cgroup (memory is capped by
``RLIMIT_AS`` per process, so up to ``RLIMIT_NPROC`` processes may each use it);
uids are picked from a high range assumed unused and, if two runs ever share
one, they share its process budget. Without root, a user namespace gives the
same namespaces and mounts but no uid drop (checked here as uid 1000); where
user namespaces are disabled, only the limits, the scrubbed environment and the
deadline remain, and ``RLIMIT_NPROC`` then counts every process of the user.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..parsing import final_text
from .math_grader import GradeStats

log = logging.getLogger(__name__)

STATS = GradeStats()  # timeouts: programs past the deadline; crashes: sandbox failures
PROTECTIONS: dict[str, object] = {}  # filled on first use, see ``protections()``

DEFAULT_TIME_LIMIT_S = 2.0
DEFAULT_MAX_TESTS = 10
STARTUP_S = 0.5  # wall-clock allowance for starting two interpreters
OUTPUT_CAP = 1 << 20  # bytes of stdout (and of stderr) kept before the run is killed
MEM_LIMIT = 1 << 30  # RLIMIT_AS of the program
FILE_LIMIT = 16 << 20  # RLIMIT_FSIZE
NPROC_LIMIT = 64  # processes (threads count too) of the program's uid
NOFILE_LIMIT = 64
SANDBOX_ERROR = 125  # the launcher's exit code when it cannot build the sandbox

_NEWNS, _NEWUTS, _NEWIPC = 0x00020000, 0x04000000, 0x08000000
_NEWUSER, _NEWPID, _NEWNET = 0x10000000, 0x20000000, 0x40000000
_ALL_NS = _NEWNET | _NEWPID | _NEWNS | _NEWIPC | _NEWUTS
_PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_UID_BASE = 0x5F000000  # fresh uids come from [base, base + 2**23): assumed unused
_uid_counter = itertools.count()

# Runs as root (or as the user) before the program: namespaces, mounts, limits,
# then the uid drop and exec. Kept free of site imports (-S) to start fast.
LAUNCHER = Path(__file__).with_name("launcher.py")


# --------------------------------------------------------------------------- #
# Extraction and comparison (pure).
# --------------------------------------------------------------------------- #

_PY_LANGS = {"", "python", "python3", "py", "py3"}
_INT = re.compile(r"[+-]?\d+")
_NUM = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?")


def extract_code(completion: str, thinking: bool | None = None) -> str | None:
    r"""The body of the last fenced Python (or untagged) block, or ``None``.

    ``thinking=None`` looks for ``</think>``/``<think>`` itself; a thinking
    completion that never closed ``</think>`` has no code.

    >>> extract_code("```python\nx = 1\n```\ntext\n```\nprint(2)\n```\n```bash\nls\n```")
    'print(2)'
    """
    if not isinstance(completion, str):
        return None
    if thinking is None:
        thinking = "</think>" in completion or "<think>" in completion
    text = final_text(completion, thinking)
    if text is None:
        return None
    # A linear line scan rather than a regex: no quadratic cost on unclosed fences.
    found, body, lang = None, None, ""
    for line in text.splitlines():
        fence = line.strip()
        if body is None:
            if fence.startswith("```"):
                words = fence[3:].split()
                lang, body = (words[0].lower() if words else ""), []
        elif fence.startswith("```"):
            if lang in _PY_LANGS:
                found = "\n".join(body)
            body = None
        else:
            body.append(line)
    return found


def _same_token(a: str, b: str) -> bool:
    if a == b:
        return True
    if _INT.fullmatch(a) and _INT.fullmatch(b):  # exact, however long
        norm = [(t[0] == "-", t.lstrip("+-").lstrip("0")) for t in (a, b)]
        return all(d == "" for _, d in norm) or norm[0] == norm[1]
    if _NUM.fullmatch(a) and _NUM.fullmatch(b):
        return math.isclose(float(a), float(b), rel_tol=1e-5, abs_tol=1e-5)
    return False


def outputs_match(got: str, expected: str) -> bool:
    r"""Token-wise, whitespace- and case-insensitive, numbers within 1e-5 (abs or rel).

    >>> outputs_match("YES\n3.0000001 \n", "yes 3"), outputs_match("1 2", "1 2 3")
    (True, False)
    """
    g, e = got.lower().split(), expected.lower().split()
    return len(g) == len(e) and all(map(_same_token, g, e))


# --------------------------------------------------------------------------- #
# Running one program.
# --------------------------------------------------------------------------- #

@dataclass
class RunResult:
    """What one run did: ``status`` is ok | error | timeout | overflow | sandbox_error."""

    status: str
    stdout: str = ""
    returncode: int | None = None
    seconds: float = 0.0
    stderr: str = field(default="", repr=False)  # the last 2000 characters

    def __repr__(self) -> str:  # stdout may be a megabyte: show its head only
        return (f"RunResult({self.status!r}, rc={self.returncode}, {self.seconds:.2f}s, "
                f"stdout={self.stdout[:60]!r}{'…' if len(self.stdout) > 60 else ''})")


# The real interpreter, not a virtualenv's link to it: a venv under /tmp would vanish
# behind the sandbox's private /tmp (and -I ignores the venv's packages anyway).
PYTHON = os.path.realpath(sys.executable)


@functools.lru_cache(maxsize=1)
def _blocked_prefix() -> list[str] | None:
    """``[hidden_dir, prefix]`` if another uid cannot reach the interpreter, else ``None``."""
    prefix = os.path.realpath(sys.base_prefix)
    path = "/"
    for part in prefix.strip("/").split("/"):
        path = os.path.join(path, part)
        if not os.stat(path).st_mode & 0o001:  # no search permission for "others"
            return [path, prefix]
    return None


def _levels() -> list[tuple[str, dict]]:
    """Isolation levels, strongest first; the probe keeps the first that works."""
    if os.geteuid() == 0:
        return [
            ("namespaces+uid", {"unshare": _ALL_NS, "mount": True, "uid": True}),
            ("namespaces", {"unshare": _ALL_NS, "mount": True, "uid": False}),
            ("network", {"unshare": _NEWNET, "mount": False, "uid": False}),
            ("none", {"unshare": 0, "mount": False, "uid": False}),
        ]
    return [
        ("user-namespaces", {"unshare": _NEWUSER | _ALL_NS, "mount": True, "uid": False}),
        ("user-network", {"unshare": _NEWUSER | _NEWNET, "mount": False, "uid": False}),
        ("none", {"unshare": 0, "mount": False, "uid": False}),
    ]


def _describe(name: str, level: dict) -> dict[str, object]:
    ns = level["unshare"]
    return {
        "level": name,
        "network_namespace": bool(ns & _NEWNET),
        "pid_namespace": bool(ns & _NEWPID),  # leftovers die with the program
        "private_tmp_and_proc": level["mount"],
        "uid_drop": level["uid"],  # fresh uid: NPROC works, parent unsignalable
        "nproc_limit": level["uid"] or os.geteuid() != 0,
        "rlimits": True,
        "scrubbed_env": True,
        "wallclock_kill": True,
    }


_probe_lock = threading.Lock()


def protections() -> dict[str, object]:
    """Probe once which isolation works here (strongest first); fills ``PROTECTIONS``."""
    with _probe_lock:
        if not PROTECTIONS:
            for i, (name, level) in enumerate(_levels()):
                res = _run("print(6 * 7)", "", 30.0, level)  # generous: a loaded machine is slow to start
                if res.status == "ok" and res.stdout.strip() == "42":
                    PROTECTIONS.update(_describe(name, level), _level=level)
                    if i:
                        log.warning("code sandbox: stronger isolation failed here; using level "
                                    "%r (%s)", name, _describe(name, level))
                    break
                log.info("code sandbox level %r unavailable: %s %s", name, res, res.stderr[-300:])
            else:
                PROTECTIONS.update(level="broken", _level=None)
                log.error("code sandbox: cannot run even an unisolated python; every program "
                          "will score 0")
        return PROTECTIONS


def _fresh_uid() -> int:
    return _UID_BASE + (os.getpid() % 2048) * 4096 + next(_uid_counter) % 4096


def _count_my_processes() -> int:
    uid, n = str(os.getuid()), 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                n += any(line.startswith("Uid:") and line.split()[1] == uid for line in f)
        except (OSError, ValueError):
            pass
    return n


def run_program(code: str, stdin: str = "", time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                mem_bytes: int = MEM_LIMIT) -> RunResult:
    """Run ``code`` once in the sandbox with ``stdin``; see the module docstring."""
    level = protections().get("_level")
    if level is None:
        return RunResult("sandbox_error")
    return _run(code, stdin, time_limit_s, level, mem_bytes)


def _run(code: str, stdin: str, time_limit_s: float, level: dict,
         mem_bytes: int = MEM_LIMIT) -> RunResult:
    t0 = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="agon-code-")
    try:
        with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8",
                  errors="replace") as f:
            f.write(code)
        uid = _fresh_uid() if level["uid"] else None
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, "solution.py"), uid, uid)
        nproc = NPROC_LIMIT if os.geteuid() == 0 else _count_my_processes() + NPROC_LIMIT
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "HOME": workdir, "PYTHONHASHSEED": "0"}
        cfg = {
            "unshare": level["unshare"], "mount": level["mount"], "uid": uid, "cwd": workdir,
            "expose": _blocked_prefix() if uid is not None else None,
            "private": [d for d in _PRIVATE_DIRS if os.path.isdir(d)],
            "rlimits": [("RLIMIT_CPU", math.ceil(time_limit_s) + 1), ("RLIMIT_AS", mem_bytes),
                        ("RLIMIT_FSIZE", FILE_LIMIT), ("RLIMIT_NPROC", nproc),
                        ("RLIMIT_NOFILE", NOFILE_LIMIT), ("RLIMIT_CORE", 0)],
            "argv": [PYTHON, "-I", "solution.py"], "env": env,
        }
        proc = subprocess.Popen(
            [PYTHON, "-I", "-S", str(LAUNCHER), json.dumps(cfg)], cwd=workdir, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)  # its own process group, killed as one below
        try:
            deadline = t0 + time_limit_s + STARTUP_S
            status, out, err = _communicate(proc, stdin.encode("utf-8", "replace"), deadline)
            if status == "ok":
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    status = "timeout"
        finally:
            if proc.poll() is None:  # first the launcher's own clean kill, see LAUNCHER
                proc.terminate()
                try:
                    proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            try:  # then whatever is left in the process group
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        rc = proc.returncode
        err_text = err.decode("utf-8", "replace")
        if status == "ok":
            if rc == SANDBOX_ERROR and err_text.startswith("agon-sandbox:"):
                status = "sandbox_error"
            elif rc in (128 + signal.SIGXCPU, 128 + signal.SIGKILL) and (
                    time.monotonic() - t0 >= time_limit_s):
                status = "timeout"  # the CPU limit struck
            elif rc != 0:
                status = "error"
        return RunResult(status, out.decode("utf-8", "replace"), rc,
                         time.monotonic() - t0, err_text[-2000:])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _communicate(proc: subprocess.Popen, data: bytes, deadline: float):
    """Feed stdin and drain stdout/stderr until EOF, the deadline, or the output cap."""
    out, err = bytearray(), bytearray()
    sinks = {proc.stdout: out, proc.stderr: err}
    with selectors.DefaultSelector() as sel:
        for stream in sinks:
            sel.register(stream, selectors.EVENT_READ)
        if data:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        sent = 0
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout", out, err
            for key, _ in sel.select(left):
                if key.fileobj is proc.stdin:
                    try:
                        sent += os.write(proc.stdin.fileno(), data[sent : sent + 65536])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        sent = len(data)  # the program stopped reading: its business
                    if sent >= len(data):
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                sink = sinks[key.fileobj]
                sink += chunk
                if len(sink) > OUTPUT_CAP:
                    return "overflow", out, err
    return "ok", out, err


# --------------------------------------------------------------------------- #
# Public API.
# --------------------------------------------------------------------------- #

def _valid_tests(tests, max_tests: int) -> list[dict]:
    ok = [t for t in (tests or []) if isinstance(t, dict) and isinstance(t.get("input"), str)
          and isinstance(t.get("output"), str)]
    # The longest inputs are the most demanding: keep those when capping.
    return sorted(ok, key=lambda t: len(t["input"]), reverse=True)[:max(0, int(max_tests))]


def grade_code(completion: str, tests: list[dict], time_limit_s: float = DEFAULT_TIME_LIMIT_S,
               max_tests: int = DEFAULT_MAX_TESTS, thinking: bool | None = None,
               mem_bytes: int = MEM_LIMIT) -> int:
    """1 if the last Python block passes every test (``{"input", "output"}``), else 0.

    Stops at the first failing test. Never raises: bad input scores 0.
    """
    try:
        code = extract_code(completion, thinking)
        chosen = _valid_tests(tests, max_tests)
        if code is None or not chosen:
            return 0
        limit = float(time_limit_s)
        if not (math.isfinite(limit) and limit > 0):
            log.warning("grade_code: time_limit_s=%r is not a positive number; using %s",
                        time_limit_s, DEFAULT_TIME_LIMIT_S)
            limit = DEFAULT_TIME_LIMIT_S
        for test in chosen:
            res = run_program(code, test["input"], limit, mem_bytes)
            if res.status == "timeout":
                STATS.timeouts += 1
            elif res.status == "sandbox_error":
                STATS.crashes += 1
                log.warning("code sandbox failed to start a program: %s", res.stderr[-300:])
            if res.status != "ok" or not outputs_match(res.stdout, test["output"]):
                return 0
        return 1
    except Exception:
        STATS.crashes += 1
        log.exception("grade_code failed; scored 0")
        return 0
    finally:
        STATS.graded += 1
