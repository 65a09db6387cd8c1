"""Launches without the imports: a pre-imported parent forks the test launches' processes.

Every process a launch starts imports torch and Accelerate first: 4-5 CPU-seconds each, on the 2 cores of
the suite's machine more than most scenarios' own work (a 2-process ``accelerate launch`` is 3 processes,
about 15 CPU-seconds of imports). This server imports them once (``PRELOAD``, nothing that reads the
environment at import: no 🤗 Hub, datasets or transformers) and then forks, for each launch:

- a **launcher** in a session of its own, as ``subprocess.Popen(start_new_session=True)`` makes it, with the
  launch's log as its output;
- below it the **ranks**, each given the environment ``accelerate launch`` gives them, built by Accelerate's
  own functions (``prepare_multi_gpu_env``, ``prepare_simple_launcher_cmd_env``) plus the variables torchrun
  sets per rank. As under torchrun, each rank of a multi-process launch has a session of its own; the
  launcher forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to every rank's process group, and when a rank fails
  it sends SIGTERM to the others' groups, then SIGKILL after 30 s, and exits 1. One process (``--cpu``) runs
  in the launcher's group and is waited for, as Accelerate's simple launcher does.

A rank then runs its script as ``python -u script args`` would (a ``__main__`` module kept until shutdown,
``sys.argv``, ``sys.path[0]``, a fresh numpy seed; Python's ``random`` reseeds itself in a forked child) and
exits through the interpreter's normal shutdown. What differs from a real launch: the ranks share the server's hash seed (a real launch
draws one per process), and the processes' command lines are the server's. ``make test-full`` and ``make
soak`` start every process from a fresh interpreter (``ACCELERATE_STATEFUL_LAUNCH=exec``); a few tests
always do (the quick start, the demo, the checker, the CLI, several simulated nodes).

Protocol: one connection per launch on a Unix socket; the client sends one JSON line (``argv``, ``env``,
``cwd``, ``log``), the server answers ``{"pid": ...}`` when the launcher is forked and ``{"exit": ...}`` (as
``Popen.returncode``) once it has ended. The server ends when the process that started it is gone.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import json
import os
import selectors
import signal
import socket
import sys
import time
import types

# The package's top level imports its parts lazily: ``accelerate_stateful.accelerator`` brings the ones every
# rank uses (73 modules, 0.19 CPU-s a rank); none reads the environment at import.
PRELOAD = ("torch", "torch.distributed", "accelerate", "accelerate_stateful", "accelerate_stateful.accelerator",
           "numpy")
# What nearly every rank imports later, at its first prepare or save, imported here too where installed: torch's
# compiler (Accelerate's unwrap_model asks whether a model is compiled) and DeepSpeed (unwrap_model imports it
# whenever it is installed). A rank that prepares, trains and saves then costs 1.4-1.7 CPU-seconds, not 3.3-4.0
# (3 launches each way). Both read the environment at import, but only the
# variables named by READ_AT_IMPORT, none of which a launch sets: a launch whose environment differs from the
# server's in any of them is not forked (mp_harness.forkable).
LATER = ("torch._dynamo", "deepspeed")
READ_AT_IMPORT = ("DS_", "TORCHDYNAMO", "TORCHINDUCTOR", "TORCH_COMPILE", "TORCH_LOGS")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # torchrun's agent's defaults
CLOSE_TIMEOUT_S = 30.0  # torchrun: SIGTERM to the other ranks, SIGKILL after this


# ------------------------------------------------------------------------------------------------ the ranks
def _exit_status(code: object) -> int:
    """What the interpreter makes of ``SystemExit(code)``."""
    if code is None:
        return 0
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code


def run_script(script: str, args: list[str], env: dict[str, str], cwd: str) -> None:
    """Become ``python -u script args`` with ``env`` (never returns)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *entries, *BASE_PATH]
    sys.argv = [script, *args]
    for sig in (*FORWARDED, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # -u would write each piece of a print() at once; whole lines keep two ranks' lines apart in one log
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    import faulthandler
    import numpy

    faulthandler.enable()  # PYTHONFAULTHANDLER, as the launch environment sets it
    numpy.random.seed()  # a fresh process's numpy draws from the OS, not the server's state
    torch = sys.modules["torch"]
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    # The interpreter's own shutdown follows (threads joined, atexit, buffers flushed), as for a script.
    sys.exit(_run_main(script))


def _run_main(script: str) -> int:
    """Run ``script`` as the ``__main__`` module, which stays in ``sys.modules`` (its globals alive) until the
    interpreter's shutdown, as a script's does: ``runpy.run_path`` would drop them when it returns, and objects a
    script keeps in globals (a process group's, a loader's) would end before the ``atexit`` handlers run."""
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = script, builtins
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    sys.modules["__main__"] = main
    try:
        with open(script, "rb") as source:
            code = compile(source.read(), script, "exec")
        exec(code, main.__dict__)
    except SystemExit as exc:
        return _exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


# --------------------------------------------------------------------------------------------- the launcher
def _accelerate_ranks(argv: list[str], env: dict[str, str]) -> tuple[list[dict[str, str]], list[str], bool]:
    """The ranks' environments, the script's argv, and whether ranks get sessions of their own."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    if args.multi_gpu and not args.cpu:
        base = prepare_multi_gpu_env(args)
        world, port = int(args.num_processes), int(args.main_process_port)
        return _torchrun_envs(base, world, port), [args.training_script, *args.training_script_args], True
    cmd, base = prepare_simple_launcher_cmd_env(args)
    return [base], cmd[1:], False


def _torchrun_ranks(argv: list[str], env: dict[str, str]) -> tuple[list[dict[str, str]], list[str], bool]:
    from torch.distributed.run import get_args_parser

    from mp_harness import free_port

    args = get_args_parser().parse_args(argv)
    world = int(args.nproc_per_node)
    return _torchrun_envs(dict(env), world, free_port()), [args.training_script, *args.training_script_args], True


def _torchrun_envs(base: dict[str, str], world: int, port: int) -> list[dict[str, str]]:
    run_id = f"zygote-{os.getpid()}"
    shared = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
              "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    return [{**base, **shared, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(world)]


def launcher(request: dict) -> None:
    """The launcher process of one launch (never returns)."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    argv, env, cwd = request["argv"], request["env"], request["cwd"]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    module = argv[2] if argv[1:2] == ["-m"] else None
    if module == "accelerate.commands.launch":
        envs, script_argv, sessions = _accelerate_ranks(argv[3:], env)
    elif module == "torch.distributed.run":
        envs, script_argv, sessions = _torchrun_ranks(argv[3:], env)
    else:  # python script args: the process itself
        run_script(argv[1], argv[2:], env, cwd)
    ranks = []
    for rank_env in envs:
        pid = os.fork()
        if pid == 0:
            if sessions:
                os.setsid()
            run_script(script_argv[0], script_argv[1:], rank_env, cwd)
        ranks.append(pid)
    os._exit(_agent(ranks) if sessions else _simple(ranks[0]))


def _simple(pid: int) -> int:
    """Accelerate's simple launcher: wait; a failed process makes the launcher fail."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    _, status = os.waitpid(pid, 0)
    return 0 if os.waitstatus_to_exitcode(status) == 0 else 1


def _agent(ranks: list[int]) -> int:
    """torchrun's agent: forward signals to every rank's group; on a failure stop the others; 1 if any failed."""
    received: list[int] = []
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    running = set(ranks)
    while running:
        if received:
            _close(running, signal.Signals(received[0]))
            return 1
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        running.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            _close(running, signal.SIGTERM)
            return 1
    return 0


def _close(running: set[int], sig: signal.Signals) -> None:
    for pid in running:
        _killpg(pid, sig)
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    while running and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            running.discard(pid)
        else:
            time.sleep(0.05)
    for pid in running:
        _killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _killpg(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------------- the server
def serve(path: str) -> None:
    import importlib.util

    for name in PRELOAD + tuple(n for n in LATER if importlib.util.find_spec(n) is not None):
        __import__(name)
    import gc

    gc.collect()
    gc.freeze()  # the imports are shared with every child: never scanned by their collections
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    print("ready", flush=True)
    clients: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=0.2):
            conn, _ = listener.accept()
            request = json.loads(_read_line(conn))
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                for other in clients.values():
                    other.close()
                conn.close()
                launcher(request)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            clients[pid] = conn
        while clients:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = clients.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
    for pid in clients:  # the tests' process is gone: so are its launches
        _killpg(pid, signal.SIGKILL)


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the client closed the connection mid-request")
        data += chunk
    return data


BASE_PATH: list[str] = []

if __name__ == "__main__":
    entries = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    BASE_PATH[:] = [p for p in sys.path[1:] if p not in entries]
    serve(sys.argv[1])
