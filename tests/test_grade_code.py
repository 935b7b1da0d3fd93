"""The code grader: output comparison, code extraction, grading, and a sandbox battery.

Adversarial programs must score 0 (or, where they "succeed" at something
harmless, leave the host untouched), return within the time limit plus the
startup allowance plus a second, and leave no process behind. Tests that rely
on an isolation this machine lacks are skipped and say which (see
``sandbox.PROTECTIONS``); on a root Linux machine all of them run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from agonlib.grading import code_grader as sandbox
from agonlib.grading.code_grader import STATS, extract_code, grade_code, outputs_match, run_program

PROT = sandbox.protections()
LIMIT_S = 1.0
BOUND_S = LIMIT_S + sandbox.STARTUP_S + 1.0  # each adversarial run returns within this


def py(code: str) -> str:
    return "Here is my solution.\n```python\n" + code.strip("\n") + "\n```\n"


def needs(*keys: str):
    missing = [k for k in keys if not PROT.get(k)]
    return pytest.mark.skipif(bool(missing), reason=f"sandbox lacks {missing} here: {PROT}")


# --------------------------------------------------------------------------- #
# Pure parts.
# --------------------------------------------------------------------------- #

# (got, expected, match)
OUTPUT_CASES = [
    ("42\n", "42", True),  # trailing newline
    ("  1   2\n3\t4 ", "1 2 3 4", True),  # any whitespace between tokens
    ("YES", "yes", True),  # case-insensitive
    ("Yes No", "yes yes", False),  # a wrong token
    ("1 2", "1 2 3", False),  # a missing token
    ("1 2 3", "1 2", False),  # an extra token
    ("", "", True),  # both empty
    ("\n\n", "", True),  # only whitespace
    ("0.333333", "0.3333333333", True),  # float within 1e-5 absolute
    ("0.3333", "0.33333333", False),  # float off by 3e-5
    ("1000000.01", "1000000", True),  # large float within 1e-5 relative
    ("3.0", "3", True),  # a float equal to an integer
    ("1e-6", "0", True),  # scientific notation, within 1e-5
    ("1e5", "100000", True),  # scientific notation, exact
    ("007", "7", True),  # integers compare by value
    ("-0", "0", True),  # negative zero
    ("+5", "5", True),  # explicit plus sign
    ("12345678901234567890123", "12345678901234567890124", False),  # long ints: exact
    ("9" * 5000, "9" * 5000, True),  # longer than Python's int-parsing limit
    ("nan", "nan", True),  # identical words are equal
    ("nan", "0", False),  # "nan" is not a number token
    ("1,2", "1 2", False),  # commas are not whitespace
    ("abc", "abd", False),  # plain words differ
]


@pytest.mark.parametrize("got,expected,match", OUTPUT_CASES)
def test_outputs_match_table(got, expected, match):
    assert outputs_match(got, expected) is match


# (completion, thinking, code)
EXTRACT_CASES = [
    ("```python\nprint(1)\n```", None, "print(1)"),  # a plain python block
    ("```\nprint(1)\n```", None, "print(1)"),  # an untagged block
    ("```py\nprint(1)\n```", None, "print(1)"),  # the py tag
    ("```python\na\n```\nthen\n```python\nb\n```", None, "b"),  # the last block wins
    ("```python\na\n```\n```cpp\nint main(){}\n```", None, "a"),  # the last *python* block
    ("no code", None, None),  # no block
    ("```python\nprint(1)\n", None, None),  # an unclosed block
    ("<think>```python\na\n```</think>\n```python\nb\n```", None, "b"),  # after </think>
    ("<think>\n```python\na\n```\n", None, None),  # unclosed think: nothing
    ("<think>\n```python\na\n```\n", False, "a"),  # thinking=False reads everything
    ("x = 1 ```python\na\n```", None, None),  # a fence must open its line
    ("```python\n```", None, ""),  # an empty block is still a block
    (None, None, None),  # not a string
]


@pytest.mark.parametrize("completion,thinking,code", EXTRACT_CASES)
def test_extract_code_table(completion, thinking, code):
    assert extract_code(completion, thinking) == code


# --------------------------------------------------------------------------- #
# Grading honest programs.
# --------------------------------------------------------------------------- #

DOUBLE = py("print(int(input()) * 2)")
TESTS = [{"input": "21\n", "output": "42\n"}, {"input": "5\n", "output": "10"}]


def test_grades_a_correct_program():
    assert grade_code(DOUBLE, TESTS) == 1


# (completion, tests, expected)
GRADE_CASES = [
    (py("print(int(input()) + 2)"), TESTS, 0),  # wrong on every test
    (py("x = int(input())\nprint(42 if x == 21 else 0)"), TESTS, 0),  # right on one test only
    (py("raise SystemExit(1)"), TESTS, 0),  # exits with an error
    (py("print(int(input()) * 2); raise ValueError"), TESTS, 0),  # right output, then a crash
    ("print(int(input()) * 2)", TESTS, 0),  # no fenced block
    (DOUBLE, [], 0),  # no tests
    (DOUBLE, [{"input": 1, "output": 2}, "junk"], 0),  # only malformed tests
    (None, TESTS, 0),  # not a string
    (py("import math; print(math.pi)"), [{"input": "", "output": "3.14159"}], 1),  # 1e-5
    (py("import sys; print(sys.stdin.read().upper())"),
     [{"input": "hello WORLD", "output": "hello world"}], 1),  # case-insensitive
    (py("print(input())"), [{"input": "λ\n", "output": "λ"}], 1),  # unicode both ways
]


@pytest.mark.parametrize("completion,tests,expected", GRADE_CASES)
def test_grade_code_table(completion, tests, expected):
    assert grade_code(completion, tests) == expected


def test_bad_time_limit_falls_back_to_the_default():
    assert grade_code(DOUBLE, TESTS, time_limit_s=float("nan")) == 1
    assert grade_code(DOUBLE, TESTS, time_limit_s="soon") == 0  # not a number: 0, no raise


def test_concurrent_grading_from_threads():
    # each run gets its own uid, work dir and namespaces
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: grade_code(DOUBLE, TESTS), range(8))) == [1] * 8


def test_max_tests_keeps_the_longest_inputs():
    # fails only on short inputs; with one test allowed, the longest is the one run
    code = py("s = input()\nprint(s if len(s) > 3 else 'wrong')")
    tests = [{"input": "ab\n", "output": "ab"}, {"input": "abcdef\n", "output": "abcdef"}]
    assert grade_code(code, tests) == 0
    assert grade_code(code, tests, max_tests=1) == 1


def test_a_megabyte_of_stdin_is_fed_whole():
    data = "x" * (1 << 20)
    assert grade_code(py("import sys; print(len(sys.stdin.read()))"),
                      [{"input": data, "output": str(len(data))}]) == 1


def test_protections_are_recorded():
    print("\nsandbox protections:", {k: v for k, v in PROT.items() if not k.startswith("_")})
    assert PROT["level"] != "broken"
    assert PROT["scrubbed_env"] and PROT["rlimits"] and PROT["wallclock_kill"]


def test_every_weaker_level_still_runs_programs():
    # the fallbacks are real code paths: each level at or below the active one must work
    names = [name for name, _ in sandbox._levels()]
    for name, level in sandbox._levels()[names.index(PROT["level"]):]:
        res = sandbox._run("print(6 * 7)", "", 5.0, level)
        assert (res.status, res.stdout.strip()) == ("ok", "42"), (name, res, res.stderr)


# --------------------------------------------------------------------------- #
# Adversarial battery.
# --------------------------------------------------------------------------- #

def sandbox_processes() -> list[int]:
    """Pids of processes still running under this process's sandbox uids (none may survive)."""
    first = sandbox._UID_BASE + (os.getpid() % 2048) * 4096  # see sandbox._fresh_uid
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, ValueError, StopIteration):
            continue
        if first <= uid < first + 4096:
            found.append(int(pid))
    return found


def timed(code: str, stdin: str = "", expected: str = "") -> tuple[int, float]:
    t0 = time.monotonic()
    score = grade_code(py(code), [{"input": stdin, "output": expected}], time_limit_s=LIMIT_S)
    return score, time.monotonic() - t0


def assert_host_fine():
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork
    assert grade_code(DOUBLE, TESTS) == 1  # and the grader still works
    time.sleep(0.1)
    assert sandbox_processes() == []  # nothing left running


def test_infinite_loop():
    before = STATS.timeouts
    score, elapsed = timed("while True:\n    pass")
    print(f"\ninfinite loop: {elapsed:.2f}s")
    assert score == 0 and elapsed < BOUND_S
    assert STATS.timeouts == before + 1
    assert_host_fine()


def test_fork_bomb():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    score, elapsed = timed(code)
    print(f"\nfork bomb: {elapsed:.2f}s")
    assert score == 0 and elapsed < BOUND_S
    assert_host_fine()


@needs("uid_drop")
def test_fork_bomb_is_capped_by_nproc():
    # with a fresh uid RLIMIT_NPROC applies: the 65th process cannot be created
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            "            time.sleep(5)\n            os._exit(0)\n        n += 1\n"
            "except OSError:\n    print(n)")
    res = run_program(code, "", LIMIT_S)
    assert res.status == "ok" and 0 < int(res.stdout) < sandbox.NPROC_LIMIT
    assert_host_fine()


def test_memory_hog():
    score, elapsed = timed("x = bytearray(8 << 30)\nprint('got 8 GiB')", expected="got 8 GiB")
    print(f"\nmemory hog: {elapsed:.2f}s")
    assert score == 0 and elapsed < BOUND_S
    assert_host_fine()


def test_gigabyte_stdout_writer():
    code = "import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * 65536)"
    res = run_program(code, "", LIMIT_S)
    score, elapsed = timed(code)
    print(f"\n1 GiB writer: {elapsed:.2f}s, {res}")
    assert res.status == "overflow" and len(res.stdout) <= sandbox.OUTPUT_CAP + 65536
    assert score == 0 and elapsed < BOUND_S
    assert_host_fine()


def test_big_file_writer():
    score, elapsed = timed("open('big', 'wb').write(b'x' * (64 << 20))\nprint('ok')", expected="ok")
    assert score == 0 and elapsed < BOUND_S  # RLIMIT_FSIZE: 16 MiB


@needs("network_namespace")
def test_network_is_unreachable():
    # a listener on the host's loopback: a sandboxed connect must not reach it
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
                "s.sendall(b'leak')\nprint('connected')")
        score, elapsed = timed(code, expected="connected")
        print(f"\nloopback connect: {elapsed:.2f}s")
        assert score == 0 and elapsed < BOUND_S
        with pytest.raises(socket.timeout):
            server.accept()
    # TEST-NET-1 (RFC 5737, never routed): unreachable at once, not after a timeout
    code = ("import socket\nsocket.create_connection(('192.0.2.1', 9), timeout=0.2)\n"
            "print('connected')")
    assert timed(code, expected="connected")[0] == 0


def test_environment_secrets_are_not_passed(monkeypatch):
    secret = "agon-fake-secret-" + uuid.uuid4().hex
    monkeypatch.setenv("AGON_FAKE_SECRET", secret)
    monkeypatch.setenv("HF_TOKEN", secret)
    code = ("import os\nvals = ' '.join(os.environ.values())\n"
            f"print('leak' if {secret!r} in vals or 'HF_TOKEN' in os.environ else 'clean')")
    assert timed(code, expected="clean")[0] == 1


@needs("pid_namespace", "private_tmp_and_proc")
def test_host_process_environments_are_hidden(monkeypatch):
    # /proc/<pid>/environ of this very process would show the secret without a fresh /proc
    secret = "agon-fake-secret-" + uuid.uuid4().hex
    monkeypatch.setenv("AGON_FAKE_SECRET", secret)
    code = ("import os\nfound = False\nfor p in os.listdir('/proc'):\n    try:\n"
            f"        found |= {secret!r}.encode() in open('/proc/%s/environ' % p, 'rb').read()\n"
            "    except OSError:\n        pass\nprint('leak' if found else 'clean')")
    assert timed(code, expected="clean")[0] == 1


def test_killing_the_parent_leaves_the_host_alive():
    # in a pid namespace getppid() is 0 and kill(0) cannot reach outside; without one,
    # the parent is the launcher, which dies and takes the run down: either way, no harm
    score, elapsed = timed("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('x')")
    assert elapsed < BOUND_S
    assert_host_fine()


@needs("pid_namespace")
def test_cannot_signal_the_grading_process():
    # this test's own pid does not exist inside the sandbox's pid namespace
    code = (f"import os, signal\ntry:\n    os.kill({os.getpid()}, signal.SIGKILL)\n"
            "    print('sent')\nexcept OSError as e:\n    print(type(e).__name__)")
    res = run_program(code, "", LIMIT_S)
    assert res.stdout.strip() in ("ProcessLookupError", "PermissionError")
    assert_host_fine()


@needs("pid_namespace")
def test_escaped_daemon_dies_with_the_run():
    # a child that leaves the process group (setsid) escapes killpg, not the namespace
    marker = "31.%d" % (uuid.uuid4().int % 10**6)
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n"
            f"    os.execv('/bin/sleep', ['sleep', '{marker}'])\ntime.sleep(0.2)\nprint('done')")
    res = run_program(code, "", LIMIT_S)
    assert res.stdout.strip() == "done"
    time.sleep(0.2)
    leftovers = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


@needs("uid_drop", "private_tmp_and_proc")
def test_writes_outside_the_work_dir_are_confined():
    # Guaranteed here: the repo (root-owned) is unwritable for the sandbox uid, and /tmp
    # is a private tmpfs thrown away with the run. NOT guaranteed: other world-writable
    # directories of the host (none besides /tmp, /var/tmp, /dev/shm, /run/lock here).
    name = "agon-escape-" + uuid.uuid4().hex
    targets = [os.path.join(os.getcwd(), name), os.path.join("/tmp", name),
               os.path.join("/dev/shm", name)]
    code = ("import sys\nfor t in sys.stdin.read().split():\n    try:\n"
            "        open(t, 'w').write('x')\n        print('wrote')\n"
            "    except OSError:\n        print('denied')")
    res = run_program(code, "\n".join(targets), LIMIT_S)
    print(f"\nwrites: {res.stdout.split()}")
    assert res.stdout.split()[0] == "denied"  # the repo
    for t in targets:
        assert not os.path.exists(t), t
    assert_host_fine()
