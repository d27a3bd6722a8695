"""The judge of assert-based tests: runs INSIDE the sandbox, in a run process of the zygote.

Not imported by honing: the zygote (``_zygote_server``) receives this file's source and
executes it into a namespace of its own, then each run process calls :func:`judge`. Stdlib
only (the sandbox's Python may be the system one). The design, and why a program cannot fool
it, is in ``code_verifier``'s docstring: the judge reads the program, forks the candidate
process (which closes every descriptor but its two RPC pipes before running the program),
and only then reads the tests and the nonce; results cross back through ``marshal`` only.
"""

import ast
import builtins
import contextlib
import importlib
import json
import marshal
import os
import struct

DATA = (type(None), bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset)


def recv(fd):
    """One length-prefixed frame from ``fd`` (EOFError if the writer is gone)."""
    head = b""
    while len(head) < 4:
        part = os.read(fd, 4 - len(head))
        if not part:
            raise EOFError("the other process ended")
        head += part
    size, chunks = struct.unpack(">I", head)[0], []
    while size:
        part = os.read(fd, min(size, 1 << 20))
        if not part:
            raise EOFError("the other process ended")
        chunks.append(part)
        size -= len(part)
    return b"".join(chunks)


def send(fd, data):
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


def plain(value, depth=0):
    """Whether ``value`` is exact builtin data all the way down (no subclass, no object)."""
    if type(value) not in DATA or depth > 50:
        return False
    if type(value) is dict:
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
    if type(value) in (tuple, list, set, frozenset):
        return all(plain(item, depth + 1) for item in value)
    return True


def candidate(program, requests, replies):
    """The candidate process: only its RPC pipes open, stdin/stdout on /dev/null."""
    keep = sorted((requests, replies))
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, 1 << 16)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    namespace = {"__name__": "__candidate__", "__builtins__": builtins}
    try:
        exec(compile(program, "<program>", "exec"), namespace)
        names = {}
        for key, value in list(namespace.items()):
            if key.startswith("__"):
                continue
            if type(value).__name__ == "module":
                names[key] = ("module", value.__name__)
            elif callable(value):
                names[key] = ("call",)
            elif plain(value):
                names[key] = ("value", value)
        send(replies, marshal.dumps(("ready", names)))
    except BaseException as exc:
        send(replies, marshal.dumps(("error", f"{type(exc).__name__}: {exc}"[:500])))
        os._exit(1)
    while True:
        name, args, kwargs = marshal.loads(recv(requests))
        try:
            data = marshal.dumps(("ok", namespace[name](*args, **kwargs)))
        except BaseException as exc:
            data = marshal.dumps(("raise", type(exc).__name__, str(exc)[:500]))
        send(replies, data)


def proxy(name, requests, replies):
    """A stand-in for the program's ``name``: calls it in the candidate process."""

    def call(*args, **kwargs):
        send(requests, marshal.dumps((name, args, kwargs)))
        reply = marshal.loads(recv(replies))
        if type(reply) is tuple and len(reply) == 2 and reply[0] == "ok" and plain(reply[1]):
            return reply[1]
        if type(reply) is tuple and len(reply) == 3 and reply[0] == "raise":
            kind = getattr(builtins, str(reply[1]), None)
            if type(kind) is type and issubclass(kind, Exception):
                raise kind(str(reply[2]))
            raise RuntimeError(f"{reply[1]}: {reply[2]}")
        raise TypeError(f"{name} returned something that is not plain builtin data")

    call.__name__ = name
    return call


def run_tests(spec, names, requests, replies, report):
    """Execute the tests statement by statement in the judge; report each test's outcome."""
    scope = {"__name__": "__tests__", "__builtins__": builtins}
    for key, kind in names.items():
        if kind[0] == "call":
            scope[key] = proxy(key, requests, replies)
        elif kind[0] == "value" and plain(kind[1]):
            scope[key] = kind[1]
        elif kind[0] == "module":
            with contextlib.suppress(Exception):
                scope[key] = importlib.import_module(str(kind[1]))
    statements = ast.parse(spec["test_code"]).body
    checks = [s for s in statements if isinstance(s, ast.FunctionDef) and s.name == "check"]
    entry = spec.get("entry_point")
    if checks and entry:
        tests = ast.parse(f"check({entry})").body
        statements = [*statements, *tests]
    else:
        tests = [s for s in statements if isinstance(s, ast.Assert)]
    report(f"total {len(tests)}")
    for statement in statements:
        code = compile(ast.Module(body=[statement], type_ignores=[]), "<tests>", "exec")
        try:
            exec(code, scope)
            ok, why = True, ""
        except BaseException as exc:
            ok, why = False, " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        if statement in tests:
            report(("pass " if ok else "fail ") + why)
        elif not ok:
            report("setup " + why)
    report("done")


def judge(stdin, channel):
    """Read the program frame from ``stdin``, fork the candidate, then read the spec frame
    (tests, entry point, nonce) and report nonce-marked lines on ``channel``."""
    program = json.loads(recv(stdin))["program"]
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(requests_w)
        os.close(replies_r)
        candidate(program, requests_r, replies_w)
        os._exit(0)
    os.close(requests_r)
    os.close(replies_w)
    spec = json.loads(recv(stdin))

    def report(message):
        os.write(channel, f"{spec['nonce']} {message}\n".encode())

    try:
        reply = marshal.loads(recv(replies_r))
    except EOFError:
        reply = ("error", "the program exited while loading")
    if type(reply) is not tuple or reply[0] != "ready" or type(reply[1]) is not dict:
        report("load " + " ".join(str(reply[-1]).split())[:300])
    else:
        run_tests(spec, reply[1], requests_w, replies_r, report)
    os.kill(pid, 9)
