"""The zygote: a long-lived Python INSIDE one worker's sandbox that forks one run per request.

Not imported by honing: ``zygote.ZygotePool`` starts it as ``python -I -c <this source>
<_judge.py source> <config JSON>`` inside bwrap/unshare/none (see ``zygote`` for the
guarantees). Stdlib only. Protocol on fd 0, a SOCK_SEQPACKET socket to the host: the zygote
sends ``{"ready": ...}`` once; then per run the host sends one JSON header (mode, limits,
uid) with four descriptors (stdin, stdout, stderr, channel pipes) and gets back one JSON
reply (``returncode``, ``timed_out``). The zygote never reads the program, the tests or the
outputs (the run reads its stdin pipe after the fork; the host reads the output pipes), so no
run's data is in the memory the next run is forked from.
"""

import atexit
import contextlib
import ctypes
import fcntl
import json
import os
import resource
import select
import shutil
import signal
import socket
import sys
import time
import traceback
import types

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
KEYCTL = {"x86_64": 250, "aarch64": 219}  # syscall numbers (no libc wrapper)
LIBC = ctypes.CDLL(None, use_errno=True)


def prctl(option, value):
    if LIBC.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl failed")


def own_processes():
    """How many processes with our uid this /proc shows (raises RLIMIT_NPROC by as many)."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                count += entry.stat().st_uid == os.getuid()
    return count


def set_limits(request):
    nproc = request["max_processes"] + (0 if request["uid"] is not None else own_processes())
    for kind, value in (
        (resource.RLIMIT_CPU, request["cpu_s"]),
        (resource.RLIMIT_AS, request["memory_bytes"]),
        (resource.RLIMIT_NPROC, nproc + 1),
        (resource.RLIMIT_FSIZE, request["max_file_bytes"]),
        (resource.RLIMIT_NOFILE, request["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_MSGQUEUE, 0),  # no POSIX message queue (they outlive the run)
    ):
        resource.setrlimit(kind, (value, value))


def run_main(stdin):
    """Stdio mode: read the program frame, then run it as ``python -I main.py`` would."""
    source = json.loads(JUDGE["recv"](stdin))["program"]
    module = types.ModuleType("__main__")
    module.__file__ = "main.py"
    sys.modules["__main__"], sys.argv, code = module, ["main.py"], 0
    try:
        exec(compile(source, "main.py", "exec"), module.__dict__)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = code or 120
    os._exit(int(code) & 0xFF)


def run_child(request, fds, run_dir):
    """The forked run: own session, the run's pipes on 0/1/2(/3), its uid, limits; then the
    judge (assert tests) or the program (stdio tests). Never returns."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    os.closerange(4, 1 << 16)
    os.setsid()
    os.chdir(run_dir)
    os.environ.update(HOME=run_dir, TMPDIR=run_dir)
    uid = request["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    prctl(PR_SET_DUMPABLE, 0)  # again: a credential change may reset it
    set_limits(request)
    if request["mode"] == "judge":
        JUDGE["judge"](0, 3)
        os._exit(0)
    os.close(3)
    run_main(0)


def wait_run(pid, deadline, control):
    """The run's exit code, or None at the deadline; exits if the host goes away."""
    pidfd = os.pidfd_open(pid)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([pidfd, control], [], [], left)
            if pidfd in ready:
                return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if control in ready and not control.recv(1, socket.MSG_PEEK):
                sweep(CONFIG, None, pid)
                os._exit(0)
    finally:
        os.close(pidfd)


def reap(patience_s=2.0):
    """Reap every child (the run's orphans are ours: we are init or a subreaper). After a
    ``kill(-1)`` every child is dying, so block; else poll, for at most ``patience_s``."""
    if CONFIG["sweep"] != "tree":
        with contextlib.suppress(ChildProcessError):
            while True:
                os.waitpid(-1, 0)
    give_up = time.monotonic() + patience_s
    while time.monotonic() < give_up:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.0005)


def sweep(config, uid, pid):
    """Kill every process of the run: as PID 1, ``kill(-1)`` (all but us); as root, a helper
    with the run's uid does ``kill(-1)`` (all of that uid) and clears that uid's user
    keyrings (the uid serves later runs: keys must not outlive this one); else the run's
    process group, then our children (orphans are re-parented to us) level by level."""
    if config["sweep"] == "init":
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
    elif config["sweep"] == "uid" and uid is not None:
        helper = os.fork()
        if helper == 0:
            os.setresuid(uid, uid, uid)
            for _ in range(2):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(-1, signal.SIGKILL)
            clear_keyrings()
            os._exit(0)
        os.waitpid(helper, 0)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        for _ in range(100):
            path = f"/proc/self/task/{os.getpid()}/children"
            with open(path) as handle:
                children = [int(word) for word in handle.read().split()]
            if not children:
                break
            for child in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            reap(0.05)
    reap()


def clean(config, uid):
    """Delete what the run left: everything in the work root (the run directory, anything
    else a namespaced run wrote there) and in the scratch dirs (private tmpfs: all; shared
    with the host: only entries owned by the run's fresh uid); SysV IPC objects (namespaced:
    all; none as root: the run uid's); the keys in our user keyrings (namespaced; none as
    root: ``sweep`` clears the run uid's)."""
    for directory, everything in [
        (config["workroot"], True),
        *((d, False) for d in config["scratch"]),
    ]:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if everything or uid is None or entry.stat(follow_symlinks=False).st_uid == uid:
                    remove(entry.path)
    namespaced = config["sweep"] == "init"
    if namespaced or uid is not None:  # never the host's own objects (none, as non-root)
        remove_ipc(uid)
    if namespaced:
        clear_keyrings()


def clear_keyrings():
    """Unlink every key of the calling uid's user keyrings."""
    if os.uname().machine in KEYCTL:
        for keyring in (-4, -5):  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
            LIBC.syscall(KEYCTL[os.uname().machine], 7, keyring)  # KEYCTL_CLEAR


def remove_ipc(uid):
    """IPC_RMID every SysV shared memory segment, message queue and semaphore set this IPC
    namespace shows (owned by ``uid``, when given)."""
    for kind, column, remove_id in (
        ("shm", "shmid", lambda ident: LIBC.shmctl(ident, 0, None)),
        ("msg", "msqid", lambda ident: LIBC.msgctl(ident, 0, None)),
        ("sem", "semid", lambda ident: LIBC.semctl(ident, 0, 0)),
    ):
        try:
            with open(f"/proc/sysvipc/{kind}") as handle:
                header, *rows = [line.split() for line in handle]
        except OSError:
            continue
        for row in rows:
            fields = dict(zip(header, row, strict=False))
            if uid is None or fields.get("uid") == str(uid):
                remove_id(int(fields[column]))


def remove(path):
    def force(function, failed, _exc_info):
        try:
            os.chmod(os.path.dirname(failed), 0o700)
            function(failed)
        except OSError:
            pass

    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, onerror=force)
    elif os.path.lexists(path):
        os.unlink(path)


def serve(request, fds, control):
    """One run: fork, wait (deadline), kill everything, clean, report."""
    run_dir = os.path.join(CONFIG["workroot"], "run")
    remove(run_dir)
    os.mkdir(run_dir, 0o700)
    if request["uid"] is not None:
        os.chown(run_dir, request["uid"], request["uid"])
    deadline = time.monotonic() + request["timeout_s"]
    pid = os.fork()
    if pid == 0:
        try:
            control.close()
            run_child(request, fds, run_dir)
        finally:
            os._exit(70)
    for fd in fds:
        os.close(fd)
    returncode = wait_run(pid, deadline, control)
    sweep(CONFIG, request["uid"], pid)
    clean(CONFIG, request["uid"])
    return {"returncode": returncode, "timed_out": returncode is None}


def main():
    control = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    prctl(PR_SET_DUMPABLE, 0)
    if CONFIG["sweep"] == "init" and os.getpid() != 1:
        raise SystemExit("the namespaced zygote must be PID 1 (its sweep is kill(-1))")
    if os.getpid() != 1:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
    control.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        message, fds, _flags, _address = socket.recv_fds(control, 1 << 16, 4)
        if not message:
            return
        try:
            reply = serve(json.loads(message), fds, control)
        except Exception as exc:
            reply = {"returncode": None, "timed_out": False, "error": f"{exc!r}"[:300]}
        control.send(json.dumps(reply).encode())


JUDGE = {"__name__": "_judge"}
exec(compile(sys.argv[1], "_judge.py", "exec"), JUDGE)
CONFIG = json.loads(sys.argv[2])
main()
