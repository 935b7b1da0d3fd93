r"""Math grader: correctness 0/1 with math-verify, in killable worker processes.

``c(y)`` of DESIGN.md §2: grade only the text after the last ``</think>`` (a
thinking model that never closed it scores 0), take the answer from the last
``\boxed{}`` (no box scores 0), and call math-verify as ``verify(gold, pred)``
with the gold wrapped in ``\boxed{}``::

    >>> grade_math("<think>half of 1</think> It is $\\boxed{0.5}$.", "\\frac{1}{2}")
    1
    >>> grade_math("<think>half of 1 is \\boxed{0.5} ...", "1/2")  # never closed </think>
    0
    >>> grade_math("\\boxed{3} no, \\boxed{4}", "4", thinking=False)  # last box wins
    1
    >>> grade_math_batch(["\\boxed{2}", "\\boxed{9^{9^{9^{9}}}}"], ["2", "2"],
    ...                  thinking=False, timeout_s=1.0)  # the tower is killed at 1 s
    [1, 0]

Why workers: sympy can hang in C code (``9^{9^{9^{9}}}`` builds a 370-million
digit integer) where math-verify's ``signal.alarm`` timeout never fires, and that
alarm only works on the main thread anyway. So math-verify runs with its own
timeouts off, in a pool of worker processes (forked off a "zygote" interpreter
that imported sympy once, so a replacement costs milliseconds), each under an
address-space limit (``RLIMIT_AS``) and a hard wall-clock deadline after which
the parent SIGKILLs it and starts a replacement. A timeout or a crash scores 0, is logged, and is
counted in ``STATS``; nothing is ever raised. The pool is created on first use,
reused across calls, and shut down at exit.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait

from agonlib.parsing import final_text, last_boxed

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
# Address space a worker may add on top of what it maps after importing sympy
# (~60 MB): relative, so a parent that imported torch before forking is fine.
WORKER_MEM_BYTES = 2 << 30
# How long the first worker may take to start (importing sympy takes ~1 s).
START_TIMEOUT_S = 60.0


@dataclass
class GradeStats:
    """Running counts of one grader; read ``STATS.as_dict()`` to log them."""

    graded: int = 0
    timeouts: int = 0
    crashes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def reset(self) -> None:
        self.graded = self.timeouts = self.crashes = 0


STATS = GradeStats()


# --------------------------------------------------------------------------- #
# The grading itself (runs inside a worker).
# --------------------------------------------------------------------------- #

def _boxed(expr: str) -> str:
    return expr if "\\boxed" in expr else "\\boxed{" + expr + "}"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str):
    # GRPO grades N completions against each gold: parse it once per worker.
    from math_verify import parse

    return parse(_boxed(gold), parsing_timeout=None)


def score_math(completion: str, gold: str, thinking: bool = True) -> int:
    r"""The unsandboxed grade: no timeout, no memory limit, may raise.

    Only the worker processes (and the throughput benchmark) call this; use
    :func:`grade_math` everywhere else.

    >>> score_math("$\\boxed{27.0}$", "27", thinking=False)
    1
    """
    from math_verify import parse, verify

    final = final_text(completion, thinking)
    if final is None:  # truncated inside <think>: a format failure
        return 0
    answer = last_boxed(final)
    if not answer:
        return 0
    gold_parsed = _parse_gold(gold)
    pred_parsed = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return 0
    return int(bool(verify(gold_parsed, pred_parsed, timeout_seconds=None)))


def _serve(conn: Connection, mem_bytes: int) -> None:
    """Worker loop: receive ``(i, completion, gold, thinking)``, send ``(i, status, score)``."""
    with open("/proc/self/status") as f:
        vm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), 0)
    limit = vm + mem_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        i, completion, gold, thinking = job
        try:
            conn.send((i, "ok", score_math(completion, gold, thinking)))
        except BaseException as exc:  # MemoryError, RecursionError, sympy bugs
            conn.send((i, "crash", f"{type(exc).__name__}: {str(exc)[:200]}"))


def _zygote_main(fd: int, mem_bytes: int) -> None:
    """Import math-verify once, then fork one worker per request byte.

    Each reply is the worker's pid, sent with one end of a fresh socket pair
    (``SCM_RIGHTS``); a reply without a descriptor is an error message.
    """
    ctl = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps dead workers
    try:
        import math_verify  # noqa: F401

        # "Timeout is disabled" warnings: we disable it on purpose, the parent kills.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        # Warm math-verify's lazy regexes and parser once, for every worker to inherit.
        score_math("\\boxed{\\frac{1}{2}}", "0.5", thinking=False)
        error = b""
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}".encode()
    while ctl.recv(1):
        if error:
            ctl.sendall(error)
            continue
        ours, theirs = socket.socketpair()
        pid = os.fork()  # safe: this interpreter never starts a thread
        if pid == 0:
            ctl.close()
            ours.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _serve(Connection(theirs.detach()), mem_bytes)
            finally:
                os._exit(0)
        theirs.close()
        socket.send_fds(ctl, [str(pid).encode()], [ours.fileno()])
        ours.close()


# --------------------------------------------------------------------------- #
# The pool.
# --------------------------------------------------------------------------- #

# The zygote is a fresh interpreter, not a multiprocessing child: ``fork`` of the
# trainer is unsafe under torch threads, and ``spawn``/``forkserver`` re-import
# the caller's ``__main__`` in the child (a script without a main guard would
# re-run itself there). Popen's fork+exec is thread-safe and imports only this
# module; forking workers off the single-threaded zygote then costs milliseconds,
# so a worker killed on a timeout is replaced before the next job needs it.
_BOOT = ("import sys; from agonlib.grading.math_grader import _zygote_main; "
         "_zygote_main(int(sys.argv[1]), int(sys.argv[2]))")


def _child_env() -> dict[str, str]:
    env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH", "TMPDIR")
           if k in os.environ}
    # The parent's import path, so agonlib resolves even when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
    return env


class _Worker:
    def __init__(self, pid: int, fd: int):
        self.pid, self.conn = pid, Connection(fd)
        try:  # a pidfd cannot hit a recycled pid
            self.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def kill(self) -> None:
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except (OSError, AttributeError):
            pass  # already gone
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self.conn.close()


class _MathPool:
    """Workers forked off one zygote, fed one job at a time, each job with a deadline."""

    def __init__(self, mem_bytes: int = WORKER_MEM_BYTES):
        self.pid = os.getpid()
        self.mem_bytes = mem_bytes
        self.zygote: subprocess.Popen | None = None
        self.ctl: socket.socket | None = None
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()

    def _start_zygote(self) -> None:
        self._stop_zygote()
        ours, theirs = socket.socketpair()
        with theirs:
            self.zygote = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno()), str(self.mem_bytes)],
                pass_fds=(theirs.fileno(),), env=_child_env(), stdin=subprocess.DEVNULL,
                start_new_session=True)  # Ctrl-C in a terminal reaches the parent only
        ours.settimeout(START_TIMEOUT_S)  # the first reply waits for the sympy import
        self.ctl = ours

    def _stop_zygote(self) -> None:
        if self.ctl is not None:
            self.ctl.close()  # EOF: the zygote exits on its own
            self.ctl = None
        if self.zygote is not None:
            try:
                self.zygote.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                self.zygote.kill()
                self.zygote.wait()
            self.zygote = None

    def _new_worker(self) -> _Worker:
        for _ in range(2):  # a dead zygote is restarted once
            try:
                if self.ctl is None:
                    self._start_zygote()
                self.ctl.sendall(b"F")
                msg, fds, _, _ = socket.recv_fds(self.ctl, 4096, 1)
            except OSError as exc:  # includes the start timeout
                err = f"{type(exc).__name__}: {exc}"
                self._stop_zygote()
                continue
            if fds:
                return _Worker(int(msg.decode()), fds[0])
            err = msg.decode(errors="replace") or "the worker factory exited"
            self._stop_zygote()
            if msg:  # an import error will not heal on a retry
                break
        raise RuntimeError(f"math grading workers cannot start ({err}); is the pinned "
                           "verifier installed? pip install 'math-verify[antlr4_13_2]==0.9.0'")

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.workers.remove(w)
        try:
            self.workers.append(self._new_worker())
        except Exception as exc:  # the loop goes on with fewer workers
            log.error("%s", exc)

    def run(self, jobs: list[tuple], timeout_s: float, n_workers: int) -> list[int]:
        results = [0] * len(jobs)
        with self.lock:
            while len(self.workers) < n_workers:
                try:
                    self.workers.append(self._new_worker())
                except Exception as exc:
                    if not self.workers:  # no worker at all: score 0, keep training
                        log.error("%s; %d answers scored 0", exc, len(jobs))
                        STATS.crashes += len(jobs)
                        return results
                    break
            busy: dict[_Worker, tuple[int, float]] = {}  # worker -> (job, deadline)
            try:
                self._dispatch(jobs, timeout_s, n_workers, results, busy)
            finally:  # interrupted (Ctrl-C): a late answer must not reach the next call
                for w in list(busy):
                    self._replace(w)
        return results

    def _dispatch(self, jobs, timeout_s, n_workers, results, busy) -> None:
        todo = deque(range(len(jobs)))
        # Workers that die while idle are replaced; a bound stops a replacement loop
        # when every new worker dies at once (e.g. a memory limit it cannot set).
        spare_lives = 2 * n_workers + 2
        while todo or busy:
            if not self.workers or spare_lives < 0:
                log.error("math grading workers keep dying; %d answers scored 0", len(todo))
                STATS.crashes += len(todo)
                return
            for w in list(self.workers):
                if not todo or w in busy or len(busy) >= n_workers:
                    continue
                i = todo.popleft()
                try:
                    if w.conn.poll():  # an idle worker only ever "says" EOF: it died
                        raise OSError("worker died while idle")
                    w.conn.send(jobs[i])
                except OSError:  # the job goes to the next worker
                    todo.appendleft(i)
                    spare_lives -= 1
                    self._replace(w)
                    continue
                busy[w] = (i, time.monotonic() + timeout_s)
            if not busy:
                continue
            wait_s = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
            for conn in wait([w.conn for w in busy], timeout=wait_s):
                w = next(w for w in busy if w.conn is conn)
                self._receive(w, busy.pop(w)[0], results, jobs)
            now = time.monotonic()
            for w, (i, deadline) in list(busy.items()):
                if now >= deadline:
                    del busy[w]
                    STATS.timeouts += 1
                    log.warning("math grading timed out after %.1fs, scored 0 (answer: %s)",
                                timeout_s, _preview(jobs[i][1]))
                    self._replace(w)

    def _receive(self, w: _Worker, i: int, results: list[int], jobs: list[tuple]) -> None:
        try:
            _, status, value = w.conn.recv()
        except (EOFError, OSError):  # killed by the kernel (segfault, OOM) mid-job
            status, value = "crash", "the worker died"
            self._replace(w)
        if status == "ok":
            results[i] = int(value)
        else:
            STATS.crashes += 1
            log.warning("math grading crashed (%s), scored 0 (answer: %s)", value,
                        _preview(jobs[i][1]))

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []
        self._stop_zygote()


def _preview(text: str, n: int = 80) -> str:
    text = repr(text)
    return text if len(text) <= n else text[: n // 2] + " … " + text[-n // 2 :]


_POOL: _MathPool | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> _MathPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():  # a forked child builds its own
            _POOL = _MathPool()
        return _POOL


@atexit.register
def shutdown() -> None:
    """Stop the worker processes (also run at exit); the next grade starts new ones."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and _POOL.pid == os.getpid():
            _POOL.close()
        _POOL = None


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


# --------------------------------------------------------------------------- #
# Public API.
# --------------------------------------------------------------------------- #

def _job(i: int, completion, gold, thinking) -> tuple | None:
    """The job tuple for a worker, or ``None`` when the input can only score 0."""
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        gold = str(gold)
    if not isinstance(completion, str) or not isinstance(gold, str) or not gold.strip():
        return None
    return (i, completion, gold.strip(), bool(thinking))


def grade_math_batch(completions, golds, thinking: bool = True,
                     timeout_s: float = DEFAULT_TIMEOUT_S, workers: int | None = None) -> list[int]:
    r"""Grade ``completions[i]`` against ``golds[i]`` in parallel; a list of 0/1.

    Each grading gets ``timeout_s`` of wall-clock time in its worker; past that
    the worker is killed and replaced and the completion scores 0.

    >>> grade_math_batch(["\\boxed{1/2}", "no box", "\\boxed{-3}"], ["0.5", "1", "3"],
    ...                  thinking=False)
    [1, 0, 0]
    """
    completions, golds = list(completions), list(golds)
    if len(completions) != len(golds):
        raise ValueError(f"grade_math_batch got {len(completions)} completions but "
                         f"{len(golds)} golds; pass one gold per completion")
    try:
        timeout_s = float(timeout_s)
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError
    except (TypeError, ValueError):
        timeout_s = DEFAULT_TIMEOUT_S
    jobs, where = [], []
    for i, (c, g) in enumerate(zip(completions, golds)):
        job = _job(len(jobs), c, g, thinking)
        if job is not None:
            jobs.append(job)
            where.append(i)
    scores = [0] * len(completions)
    if jobs:
        try:
            n = max(1, min(int(workers or default_workers()), len(jobs)))
            for i, score in zip(where, _pool().run(jobs, timeout_s, n)):
                scores[i] = int(score)
        except Exception:  # the pool itself failed (cannot fork?): score 0, keep training
            STATS.crashes += len(jobs)
            log.exception("math grading pool failed; %d answers scored 0", len(jobs))
    STATS.graded += len(completions)
    return scores


def grade_math(completion: str, gold: str, thinking: bool = True,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """0/1 correctness of one completion (see the module docstring); never raises."""
    try:
        return grade_math_batch([completion], [gold], thinking, timeout_s, workers=1)[0]
    except Exception:
        log.exception("grade_math failed; scored 0")
        return 0
