"""Does this interpreter survive a fork while a native thread attaches to it? (CPython gh-112275)

A process group's worker threads attach to the interpreter (``PyGILState_Ensure``) whenever they free a tensor
Python owned; a DataLoader worker forked at that instant can hang inside ``os.fork()`` for ever. This script
reproduces the race without torch: a small C library (built here with ``cc``) runs native threads that attach
and detach in a loop, while the main thread forks children that exit at once. A child still running after
``--wait-s`` is counted as hung (then killed).

    python benchmarks/fork_race.py --seconds 25 /root/.pyenv/versions/3.11.7/bin/python3 python3.12

docs/reliability.md records the figures. Needs a C compiler and each interpreter's headers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CHURN_C = r"""
#include <Python.h>
#include <pthread.h>
static volatile int running = 1;
static void *churn(void *arg) {
    (void)arg;
    while (running) {  /* a thread without a thread state: each Ensure creates one, each Release deletes it */
        PyGILState_STATE s = PyGILState_Ensure();
        PyGILState_Release(s);
    }
    return NULL;
}
int start_churn(int n) {
    for (int i = 0; i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, churn, NULL) != 0) return -1;
        pthread_detach(t);
    }
    return 0;
}
void stop_churn(void) { running = 0; }
"""

CHILD = r"""
import ctypes, os, signal, sys, time
lib = ctypes.PyDLL(sys.argv[1])
seconds, threads, wait_s = float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
lib.start_churn(threads)
forks = hung = crashed = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    end = time.monotonic() + wait_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > end:
            break
        time.sleep(0.005)
    forks += 1
    if not done:
        hung += 1
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    elif os.WIFSIGNALED(status):
        crashed += 1
lib.stop_churn()
print(f"{sys.version.split()[0]} {forks} {hung} {crashed}", flush=True)
os._exit(0)
"""


def measure(python: str, seconds: float, threads: int, wait_s: float, folder: Path) -> str:
    include = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                                      text=True).strip()
    version = subprocess.check_output([python, "-c", "import sys; print(sys.version.split()[0])"], text=True).strip()
    source, library, child = folder / "churn.c", folder / f"churn-{version}.so", folder / "child.py"
    source.write_text(CHURN_C)
    child.write_text(CHILD)
    subprocess.check_call(["cc", "-O2", "-shared", "-fPIC", f"-I{include}", "-o", str(library), str(source)])
    out = subprocess.run([python, "-W", "ignore", str(child), str(library), str(seconds), str(threads), str(wait_s)],
                         capture_output=True, text=True, timeout=seconds + 120)
    found, forks, hung, crashed = out.stdout.split()
    return f"| {found} | {forks} | {hung} | {crashed} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pythons", nargs="*", default=[sys.executable])
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--threads", type=int, default=2, help="native threads attaching in a loop")
    parser.add_argument("--wait-s", type=float, default=0.3, help="a child still running then is hung")
    args = parser.parse_args()
    print("| Python | forks | children hung in fork | children crashed |\n| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for python in args.pythons:
            print(measure(python, args.seconds, args.threads, args.wait_s, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
