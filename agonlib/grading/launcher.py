"""The sandbox launcher: runs as root (or as the user) before a program, in its own process.

Started by :func:`agonlib.grading.code_grader.run_program` as ``python -I -S launcher.py CONFIG``
(isolated mode: no script directory on ``sys.path``, no site imports, so it starts fast and
imports nothing of agonlib). ``CONFIG`` (JSON) says which namespaces, mounts and limits to set
up; then it drops to a fresh uid and execs the program. Exits with ``SANDBOX_ERROR`` (125) and
an ``agon-sandbox:`` message when it cannot build the sandbox.
"""
import ctypes
import json
import os
import resource
import signal
import sys

cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
NOSUID, NODEV, NOEXEC, BIND, REC, PRIVATE = 2, 4, 8, 0x1000, 0x4000, 0x40000  # MS_*

def die(what):
    msg = "agon-sandbox: %s: %s\n" % (what, os.strerror(ctypes.get_errno()))
    os.write(2, msg.encode())
    os._exit(125)

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        die("mount " + dst)

def write(path, text):
    with open(path, "w") as f:
        f.write(text)

uid, gid = os.getuid(), os.getgid()
if cfg["unshare"] and libc.unshare(cfg["unshare"]) != 0:
    die("unshare")
if cfg["unshare"] & 0x10000000:  # a user namespace: be root inside, the user outside
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", "0 %d 1" % uid)
    write("/proc/self/gid_map", "0 %d 1" % gid)
# SIGTERM from the grader: kill the program and reap it here, so it never lingers
# as a zombie of the host's init (killing its whole namespace with it).
signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
pid = os.fork()  # the child is pid 1 of the new pid namespace
if pid:
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
script = os.path.join(cfg["cwd"], "solution.py")
with open(script, "rb") as f:
    code = f.read()
if cfg["mount"]:
    mount(None, "/", None, REC | PRIVATE)  # no mount below propagates to the host
    if cfg["expose"]:
        hidden, prefix = cfg["expose"]
        fd = os.open(prefix, os.O_PATH | os.O_DIRECTORY)
        mount("tmpfs", hidden, "tmpfs", NOSUID | NODEV, "size=1m,mode=755")
        os.makedirs(prefix, exist_ok=True)
        mount("/proc/self/fd/%d" % fd, prefix, None, BIND | REC)
        os.close(fd)
    for d in cfg["private"]:
        mount("tmpfs", d, "tmpfs", NOSUID | NODEV, "size=64m,mode=1777")
    if cfg["unshare"] & 0x20000000:
        mount("proc", "/proc", "proc", NOSUID | NODEV | NOEXEC)  # this namespace's pids only
    if not os.path.exists(script):  # the work dir is under a private tmpfs now: rebuild it
        os.makedirs(cfg["cwd"], mode=0o700)
        with open(script, "wb") as f:
            f.write(code)
        if cfg["uid"] is not None:
            os.chown(cfg["cwd"], cfg["uid"], cfg["uid"])
os.chdir(cfg["cwd"])
for name, value in cfg["rlimits"]:
    resource.setrlimit(getattr(resource, name), (value, value))
if cfg["uid"] is not None:
    os.setgroups([])
    os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binary gets root back
libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG = SIGKILL: dies with the launcher
os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
