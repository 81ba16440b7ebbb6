"""Run a command with this process as its child subreaper, so that whatever
the command leaves running (a Ray daemon, a worker) is reparented here
instead of to init; print those leftovers as the last line (JSON), kill them,
and exit with the command's status. The tests' leak check for runs whose
processes are not their own children.

    python tests/reaped.py CMD ARGS..."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def main() -> int:
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    rc = subprocess.call(sys.argv[1:])
    left = []
    deadline = time.monotonic() + 5       # daemons that are on their way out get a moment
    while time.monotonic() < deadline:
        while True:                       # reap zombies reparented here
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        left = descendants(os.getpid())
        if not left:
            break
        time.sleep(0.2)
    names = []
    for pid in left:
        try:
            names.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:120])
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    print(json.dumps({"leftover": names}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
