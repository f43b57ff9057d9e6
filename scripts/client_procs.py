#!/usr/bin/env python3
"""Lock benchmarks with client *processes*, as kazoo and python-redis-lock are used.

Every point runs P separate OS processes as lock clients (multiprocessing,
forkserver start method), each with one connection of its own, against:

  sidelock-redis     two sidelock sidecars on Redis; HTTP/1.1 keep-alive with
                     http.client, ``POST /v1/locks/{name}?ttl=60s&wait=60s``,
                     ``DELETE /v1/locks/{name}?token=…``
  python-redis-lock  ``redis_lock.Lock``, blocking acquire (``SET NX EX``, then
                     ``BLPOP`` on a signal list that the release pushes to)
  redis-plain        redis-py: ``SET key token NX PX 60000``, tried again after a
                     1 ms sleep while the lock is busy; token-checked Lua ``DEL``
  sidelock-zk        two sidelock sidecars on ZooKeeper, as sidelock-redis
  kazoo              kazoo's ``Lock`` recipe (ephemeral sequential znodes; one
                     ``Lock`` object per process, reused)

The three Redis systems share one redis-server, the two ZooKeeper systems one
standalone ZooKeeper. Leases are 60 s and nobody waits longer than 60 s.

Workloads:

  uncontended       P processes, each its own lock, loop acquire -> release
                    (sidelock: every process on the first sidecar). Pairs/s over
                    all processes, acquire and release latency.
  contended         P processes on one lock (sidelock: process i on sidecar
                    i % 2). Each loops acquire -> release at once -> waits until
                    another process has been granted before asking again, so
                    every grant is a handoff. Handoffs/s, handoff latency (the
                    holder sending its release -> the next holder receiving its
                    grant, CLOCK_MONOTONIC, comparable across processes), max wait.
  contended_greedy  the same without the wait rule: a process asks again as soon
                    as it has released. *Regrants* are the grants that went to
                    the process that released last; under the rule they cannot
                    happen (the releaser does not ask until someone else holds).

With a FIFO lock (sidelock's queue, kazoo's sequential znodes) regrants stay
near 0 whenever another process waits; a lock that lets the releaser barge in
(python-redis-lock, the polling recipe) shows them, and a longer max wait.

Backend cost per pair / per grant, counted over the measured window:
  * Redis ``INFO commandstats``: *commands*, everything Redis executed including
    what scripts ran; *top-level*, what crossed the network: for sidelock the
    script calls and the commands a script cannot run (the rule of
    sidelock-bench's counters), for the baselines the commands their redis-py
    connections sent (counted by the clients).
  * ZooKeeper ``mntr`` ``zk_packets_received`` (session pings included), in both
    columns.
  * CPU time (``utime + stime`` of ``/proc/<pid>/stat``, all threads) of the
    backend's server process (redis-server, the ZooKeeper JVM), of the sidecars,
    and of the client processes themselves, divided by the pairs or grants.

Every contended grant also checks that no other process is inside its critical
section (``overlaps``, shown with the errors; always 0 for a correct lock).

It starts what it needs on free loopback ports: a redis-server (no
persistence) unless ``--redis`` is given, a standalone ZooKeeper (Debian's jars
in /usr/share/java, as scripts/bench.sh starts it) unless ``--zookeeper`` is
given, and two fresh sidecars per sidelock system (``--sidelock``, default
target/release/sidelock), stopped before the next system runs. It stops every
process it started, also on Ctrl-C or failure, and raises its open-file limit
to the hard limit. Each point warms up (``--warmup``) before its counters are
read; before the first point, a ZooKeeper server (a JVM, which compiles its
request path during its first seconds of load) is loaded with every selected
system's workloads, unmeasured (``--server-warmup``), so that the system
measured first does not pay for the compilation.

Run (after ``cargo build --release --bins``):

  python3 -m venv .venv-bench && .venv-bench/bin/pip install -r scripts/requirements-bench.txt
  .venv-bench/bin/python scripts/client_procs.py --duration 5 --json client-procs.json

Prints a markdown table per workload on stdout (progress on stderr), writes
the JSON to ``--json``, and exits 1 when any point failed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import multiprocessing as mp
import os
import platform
import queue
import resource
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

try:
    import redis
    import redis_lock
    from kazoo.client import KazooClient
except ImportError as missing:
    sys.exit(
        f"client_procs: Python package {missing.name!r} is missing: "
        "pip install -r scripts/requirements-bench.txt"
    )

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = ("sidelock-redis", "python-redis-lock", "redis-plain", "sidelock-zk", "kazoo")
BACKEND_OF = {
    "sidelock-redis": "redis",
    "python-redis-lock": "redis",
    "redis-plain": "redis",
    "sidelock-zk": "zookeeper",
    "kazoo": "zookeeper",
}
WORKLOADS = ("uncontended", "contended", "contended_greedy")
# Servers whose hot paths a JIT compiles under load: warmed up before the first point.
JIT_BACKENDS = {"zookeeper"}

TTL_S = 60  # every lease
WAIT_S = 60  # the longest an acquire waits (python-redis-lock allows at most its ttl)
POLL_S = 0.001  # redis-plain's sleep between tries while the lock is busy
READY_TIMEOUT_S = 60  # for servers, sidecars and client processes to come up
STOP_TIMEOUT_S = 15  # for a process to end before it is killed
START_MARGIN_NS = 50_000_000  # counters read -> measured window, so every client starts on time
CLK_TCK = os.sysconf("SC_CLK_TCK")

ZK_JARS = (
    "/usr/share/java/zookeeper.jar",
    "/usr/share/java/slf4j-log4j12.jar",
    "/usr/share/java/log4j-1.2.jar",
)
RELEASE_LUA = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end"
# Commands a client sends itself, never run inside a script.
TOP_LEVEL = {
    "subscribe", "unsubscribe", "psubscribe", "punsubscribe", "ssubscribe",
    "sunsubscribe", "script", "client", "hello", "ping", "select", "auth",
    "cluster", "scan", "multi", "exec",
}  # fmt: skip


class SetupError(Exception):
    """Something the harness needs is missing or did not start."""


class PointError(Exception):
    """A measurement that could not be completed."""


class LockError(Exception):
    """An acquire or release that did not succeed."""


def missing_tools() -> list[str]:
    """What this machine lacks to run every system, each with how to get it."""
    missing = []
    if not shutil.which("redis-server"):
        missing.append("redis-server (Debian package redis-server)")
    if not shutil.which("java") or not all(Path(j).is_file() for j in ZK_JARS):
        missing.append(f"ZooKeeper (java and {', '.join(ZK_JARS)}; Debian packages zookeeper, default-jdk-headless)")
    return missing


def die_with_parent() -> None:
    """Asks the kernel to SIGTERM this process when its parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def exit_with(pid: int) -> None:
    """Ends this process as soon as process ``pid`` has ended (a client
    process's parent is the forkserver, which outlives a killed harness)."""
    pidfd = os.pidfd_open(pid)

    def watch() -> None:
        select.select([pidfd], [], [])
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


# --------------------------------------------------------------------------
# Lock clients, one per client process.


class CountingRedis(redis.Redis):
    """redis-py's client, counting the commands it sends (its top-level calls)."""

    sent = 0

    def execute_command(self, *args, **options):
        self.sent += 1
        return super().execute_command(*args, **options)


class SidelockClient:
    """One keep-alive HTTP/1.1 connection to a sidecar (reopened after an error)."""

    top_level = None  # the sidecar's commands are counted by the backend

    def __init__(self, base_url: str):
        url = urllib.parse.urlsplit(base_url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=WAIT_S + 10)

    def _call(self, method: str, path: str) -> dict:
        try:
            self.conn.request(method, path)
            resp = self.conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            raise
        if resp.status != 200:
            raise LockError(f"{method} {path.split('?')[0]}: {resp.status} {body[:300]!r}")
        return json.loads(body)

    def acquire(self, name: str) -> str:
        return self._call("POST", f"/v1/locks/{name}?ttl={TTL_S}s&wait={WAIT_S}s")["token"]

    def release(self, name: str, token: str) -> None:
        self._call("DELETE", f"/v1/locks/{name}?token={urllib.parse.quote(token, safe='')}")

    def close(self) -> None:
        self.conn.close()


class PythonRedisLockClient:
    """python-redis-lock, one ``Lock`` object per name."""

    def __init__(self, url: str):
        self.conn = CountingRedis.from_url(url, socket_timeout=WAIT_S + 10)
        self.locks: dict[str, redis_lock.Lock] = {}

    @property
    def top_level(self) -> int:
        return self.conn.sent

    def acquire(self, name: str) -> redis_lock.Lock:
        if name not in self.locks:
            self.locks[name] = redis_lock.Lock(self.conn, name, expire=TTL_S)
        lock = self.locks[name]
        if not lock.acquire(blocking=True, timeout=WAIT_S):
            raise LockError(f"python-redis-lock: not acquired in {WAIT_S} s")
        return lock

    def release(self, name: str, lock: redis_lock.Lock) -> None:
        lock.release()

    def close(self) -> None:
        self.conn.close()


class PlainRedisClient:
    """The plain recipe: SET NX PX, a 1 ms sleep between tries, Lua compare-and-delete."""

    def __init__(self, url: str):
        self.conn = CountingRedis.from_url(url, socket_timeout=10)
        self.unlock = self.conn.register_script(RELEASE_LUA)

    @property
    def top_level(self) -> int:
        return self.conn.sent

    def acquire(self, name: str) -> tuple[str, str]:
        key, token = f"plain:{name}", secrets.token_hex(16)
        give_up = time.monotonic() + WAIT_S
        while not self.conn.set(key, token, nx=True, px=TTL_S * 1000):
            if time.monotonic() > give_up:
                raise LockError(f"SET NX: not acquired in {WAIT_S} s")
            time.sleep(POLL_S)
        return key, token

    def release(self, name: str, lease: tuple[str, str]) -> None:
        if self.unlock(keys=[lease[0]], args=[lease[1]]) != 1:
            raise LockError("release: the lease was gone")

    def close(self) -> None:
        self.conn.close()


class KazooLockClient:
    """kazoo's Lock recipe on one session, one ``Lock`` object per name."""

    top_level = None  # counted by ZooKeeper

    def __init__(self, hosts: str):
        self.zk = KazooClient(hosts=hosts, timeout=10.0)
        self.zk.start(timeout=READY_TIMEOUT_S)
        self.locks: dict[str, object] = {}

    def acquire(self, name: str):
        if name not in self.locks:
            self.locks[name] = self.zk.Lock(f"/client-procs/{name}")
        lock = self.locks[name]
        if not lock.acquire(blocking=True, timeout=WAIT_S):
            raise LockError(f"kazoo: not acquired in {WAIT_S} s")
        return lock

    def release(self, name: str, lock) -> None:
        lock.release()

    def close(self) -> None:
        self.zk.stop()
        self.zk.close()


def open_client(system: str, target: str):
    """The lock client of ``system``, connected to ``target`` (a sidecar URL,
    the Redis URL or ZooKeeper's ``host:port``)."""
    if system.startswith("sidelock-"):
        return SidelockClient(target)
    return {
        "python-redis-lock": PythonRedisLockClient,
        "redis-plain": PlainRedisClient,
        "kazoo": KazooLockClient,
    }[system](target)


# --------------------------------------------------------------------------
# What one point's client processes run.


@dataclass(frozen=True)
class Point:
    """One measurement: a system, a workload and a process count."""

    system: str
    workload: str
    procs: int
    duration_s: float
    warmup_s: float
    lock: str
    # Process i connects to targets[i % len(targets)].
    targets: tuple[str, ...]


@dataclass
class Shared:
    """Shared memory of one point's processes; -1 is nobody, 0 no time yet."""

    barrier: object  # the client processes and the harness, at each phase
    start_ns: object  # when the measured window begins
    holder: object  # the process granted last
    inside: object  # the process in its critical section
    released_ns: object  # when the last holder sent its release
    gates: list  # per process, the wait rule: set when another process is granted

    @classmethod
    def create(cls, ctx, procs: int, rule: bool) -> Shared:
        return cls(
            barrier=ctx.Barrier(procs + 1),
            start_ns=ctx.RawValue("q", 0),
            holder=ctx.RawValue("q", -1),
            inside=ctx.RawValue("q", -1),
            released_ns=ctx.RawValue("q", 0),
            gates=[ctx.Event() for _ in range(procs)] if rule else [],
        )

    def reset(self) -> None:
        self.holder.value = self.inside.value = -1
        self.released_ns.value = 0
        for gate in self.gates:
            gate.clear()


class Errors:
    """Failed calls of one process: how many, and the first one's message."""

    def __init__(self):
        self.count = 0
        self.first: str | None = None

    def add(self, e: Exception) -> None:
        self.count += 1
        self.first = self.first or f"{type(e).__name__}: {e}"
        time.sleep(0.001)


def pairs_loop(client, name: str, end_ns: int) -> dict:
    """Uncontended: acquire -> release on one's own lock until ``end_ns``."""
    now = time.monotonic_ns
    acquire, release, errors = [], [], Errors()
    while now() < end_ns:
        t0 = now()
        try:
            lease = client.acquire(name)
            t1 = now()
            client.release(name, lease)
        except Exception as e:
            errors.add(e)
            continue
        acquire.append(t1 - t0)
        release.append(now() - t1)
    return {"acquire_ns": acquire, "release_ns": release, "errors": errors.count, "first_error": errors.first}


class Grants:
    """One process's record of a contended workload."""

    def __init__(self, shared: Shared, me: int, end_ns: int):
        self.shared, self.me, self.end_ns = shared, me, end_ns
        self.n = dict(grants=0, late=0, handoffs=0, regrants=0, overlaps=0)
        self.handoff_ns: list[int] = []
        self.wait_ns: list[int] = []

    def granted(self, asked_ns: int, granted_ns: int) -> None:
        """Books a grant (the lock is held) and wakes the previous holder."""
        s, n = self.shared, self.n
        n["overlaps"] += s.inside.value != -1
        s.inside.value = self.me
        previous, s.holder.value = s.holder.value, self.me
        if s.gates and previous not in (-1, self.me):
            s.gates[previous].set()
        if granted_ns >= self.end_ns:
            n["late"] += 1
            return
        n["grants"] += 1
        self.wait_ns.append(granted_ns - asked_ns)
        if previous == self.me:
            n["regrants"] += 1
        elif previous != -1:
            n["handoffs"] += 1
            self.handoff_ns.append(granted_ns - s.released_ns.value)

    def releasing(self) -> None:
        """Leaves the critical section: the release is about to be sent."""
        if self.shared.gates:
            self.shared.gates[self.me].clear()
        self.shared.inside.value = -1
        self.shared.released_ns.value = time.monotonic_ns()

    def wait_for_another(self) -> None:
        """The wait rule: until another process is granted (or the end)."""
        if self.shared.gates:
            left = (self.end_ns - time.monotonic_ns()) / 1e9
            self.shared.gates[self.me].wait(max(0.0, left))


def handoff_loop(client, name: str, me: int, shared: Shared, end_ns: int) -> dict:
    """Contended: acquire -> release at once until ``end_ns``, then leave."""
    now = time.monotonic_ns
    record, errors = Grants(shared, me, end_ns), Errors()
    while now() < end_ns:
        asked = now()
        try:
            lease = client.acquire(name)
        except Exception as e:
            errors.add(e)
            continue
        record.granted(asked, now())
        record.releasing()
        try:
            client.release(name, lease)
        except Exception as e:
            errors.add(e)
        record.wait_for_another()
    return {
        **record.n,
        "handoff_ns": record.handoff_ns,
        "wait_ns": record.wait_ns,
        "errors": errors.count,
        "first_error": errors.first,
    }


def run_workload(point: Point, me: int, shared: Shared, client, end_ns: int) -> dict:
    if point.workload == "uncontended":
        return pairs_loop(client, f"{point.lock}-{me}", end_ns)
    return handoff_loop(client, point.lock, me, shared, end_ns)


def client_main(point: Point, me: int, shared: Shared, results, harness: int) -> None:
    """One client process: connect, warm up, run the measured window, report.

    Its phases meet the harness at the shared barrier: connected, warmed up,
    started (the harness has read the counters), finished (read them again).
    """
    exit_with(harness)
    client = None
    try:
        client = open_client(point.system, point.targets[me % len(point.targets)])
        shared.barrier.wait(READY_TIMEOUT_S)
        if point.warmup_s > 0:
            run_workload(point, me, shared, client, time.monotonic_ns() + int(point.warmup_s * 1e9))
        shared.barrier.wait(point.warmup_s + WAIT_S + READY_TIMEOUT_S)
        shared.barrier.wait(READY_TIMEOUT_S)
        start = shared.start_ns.value
        time.sleep(max(0, start - time.monotonic_ns()) / 1e9)
        cpu, sent = time.process_time(), client.top_level
        stats = run_workload(point, me, shared, client, start + int(point.duration_s * 1e9))
        stats["elapsed_ns"] = time.monotonic_ns() - start
        stats["cpu_s"] = time.process_time() - cpu
        stats["top_level"] = None if sent is None else client.top_level - sent
        results.put((me, stats))
        shared.barrier.wait(point.duration_s + WAIT_S + READY_TIMEOUT_S)
    except (KeyboardInterrupt, threading.BrokenBarrierError):
        pass  # stopped, or another process failed and said why
    except Exception as e:
        results.put((me, {"fatal": f"process {me}: {type(e).__name__}: {e}"}))
        shared.barrier.abort()
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()


# --------------------------------------------------------------------------
# Servers, sidecars and what they count.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_ticks(pid: int | None) -> int | None:
    """``utime + stime`` of ``pid`` (all its threads), in clock ticks."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def four_letter(hostport: str, word: str) -> str:
    """ZooKeeper's answer to a four-letter word (``ruok``, ``mntr``)."""
    host, port = hostport.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(word.encode())
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def mntr(hostport: str) -> dict[str, str]:
    return dict(line.split("\t", 1) for line in four_letter(hostport, "mntr").splitlines() if "\t" in line)


class Processes:
    """The server processes this harness started; ``stop_all`` ends them."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.running: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C reaches the harness, which stops them in order
                preexec_fn=die_with_parent,
            )
        self.running.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            text = (self.logs / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, name: str, proc: subprocess.Popen, ready, what: str) -> None:
        """Waits until ``ready()`` is true, failing if ``proc`` exits first."""
        give_up = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            if proc.poll() is not None:
                raise SetupError(f"{what} exited with {proc.returncode}; its log:\n{self.log_tail(name)}")
            if time.monotonic() > give_up:
                raise SetupError(f"{what} not ready after {READY_TIMEOUT_S} s; its log:\n{self.log_tail(name)}")
            time.sleep(0.05)

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.running = [(n, p) for n, p in self.running if p is not proc]

    def stop_all(self) -> None:
        for _, proc in reversed(self.running):
            self.stop(proc)


@dataclass
class Backend:
    """A Redis server or a ZooKeeper: where clients connect, how to count it."""

    kind: str  # "redis" or "zookeeper"
    target: str  # redis://host:port, or host:port
    pid: int | None  # the server process on this machine, for CPU
    version: str

    def sidecar_url(self) -> str:
        return self.target if self.kind == "redis" else f"zk://{self.target}"

    def ops(self, info_conn) -> dict[str, int]:
        """Operations executed so far: Redis ``commands`` and ``top_level``,
        ZooKeeper ``packets``."""
        if self.kind == "zookeeper":
            return {"packets": int(mntr(self.target)["zk_packets_received"])}
        calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in info_conn.info("commandstats").items()}
        calls.pop("info", None)  # the harness's own
        top = sum(n for name, n in calls.items() if is_top_level(name))
        return {"commands": sum(calls.values()), "top_level": top}


def is_top_level(command: str) -> bool:
    base = command.split("|")[0]
    return base.startswith(("eval", "fcall")) or base in TOP_LEVEL


def redis_backend(procs: Processes, url: str | None) -> Backend:
    """The Redis at ``url``, or a redis-server of our own."""
    if url is None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SetupError("redis-server not found: install it with scripts/setup.sh (Debian package redis-server)")
        port = free_port()
        url = f"redis://127.0.0.1:{port}"
        proc = procs.start(
            "redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        )
        procs.wait_ready("redis", proc, lambda: redis_answers(url), f"redis-server on port {port}")
    elif not redis_answers(url):
        raise SetupError(f"no Redis answers at {url}")
    info = redis.Redis.from_url(url, socket_timeout=5).info("server")
    pid = info.get("process_id")
    local = pid is not None and Path(f"/proc/{pid}/comm").is_file() and "redis" in Path(f"/proc/{pid}/comm").read_text()
    return Backend("redis", url, pid if local else None, f"redis-server {info.get('redis_version')}")


def redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def zookeeper_backend(procs: Processes, workdir: Path, hostport: str | None, pid: int | None) -> Backend:
    """The ZooKeeper at ``hostport`` (``mntr`` allowed), or one of our own."""
    if hostport is None:
        hostport, pid = start_zookeeper(procs, workdir)
    try:
        stats = mntr(hostport)
    except OSError as e:
        raise SetupError(f"ZooKeeper at {hostport}: {e}") from e
    if "zk_packets_received" not in stats:
        raise SetupError(f"ZooKeeper at {hostport} does not answer mntr (add it to 4lw.commands.whitelist)")
    return Backend("zookeeper", hostport, pid, f"ZooKeeper {stats.get('zk_version', '?').split('-')[0]}")


def start_zookeeper(procs: Processes, workdir: Path) -> tuple[str, int]:
    """A standalone ZooKeeper from Debian's jars, configured as scripts/bench.sh does."""
    if missing := [m for m in missing_tools() if m.startswith("ZooKeeper")]:
        raise SetupError(f"{missing[0]} not found: install it with scripts/setup.sh")
    zkdir = workdir / "zookeeper"
    zkdir.mkdir()
    port = free_port()
    (zkdir / "zoo.cfg").write_text(
        f"tickTime=200\ndataDir={zkdir}/data\nclientPort={port}\nclientPortAddress=127.0.0.1\n"
        "4lw.commands.whitelist=mntr\nadmin.enableServer=false\n"
        "minSessionTimeout=400\nmaxSessionTimeout=60000\nmaxClientCnxns=0\n"
    )
    (zkdir / "log4j.properties").write_text(
        "log4j.rootLogger=WARN, CONSOLE\n"
        "log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender\n"
        "log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout\n"
        "log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} %-5p %m%n\n"
    )
    argv = [
        shutil.which("java"), "-Xms64m", "-Xmx512m", "-Dzookeeper.jmx.log4j.disable=true",
        "-cp", ":".join([str(zkdir), *ZK_JARS]),
        "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(zkdir / "zoo.cfg"),
    ]  # fmt: skip
    proc = procs.start("zookeeper", argv)
    hostport = f"127.0.0.1:{port}"
    procs.wait_ready("zookeeper", proc, lambda: zk_serving(hostport), f"ZooKeeper on port {port}")
    return hostport, proc.pid


def zk_serving(hostport: str) -> bool:
    """Whether ZooKeeper serves requests (``ruok`` says imok before it does)."""
    try:
        return "zk_server_state" in mntr(hostport)
    except OSError:
        return False


def http_status(url: str) -> int | None:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=2)
    try:
        conn.request("GET", parts.path)
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


@dataclass
class Sidecar:
    url: str
    proc: subprocess.Popen


def start_sidecar(
    procs: Processes, sidelock: Path, backend: Backend, sidecar_id: str, threads: int | None = None
) -> Sidecar:
    """``sidelock serve`` on a free port, ready (``GET /readyz`` 200); ``threads``: its ``--threads``."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDELOCK_")}
    env["SIDELOCK_LOG"] = "warn"
    argv = [
        str(sidelock), "serve", "--listen", f"127.0.0.1:{port}", "--backend", backend.sidecar_url(),
        "--sidecar-id", sidecar_id, "--max-waiters", "100000",
    ]  # fmt: skip
    if threads is not None:
        argv += ["--threads", str(threads)]
    proc = procs.start(sidecar_id, argv, env)
    url = f"http://127.0.0.1:{port}"
    procs.wait_ready(sidecar_id, proc, lambda: http_status(f"{url}/readyz") == 200, f"sidecar {sidecar_id}")
    return Sidecar(url, proc)


class Meter:
    """Backend operations and CPU ticks of the processes serving one system."""

    def __init__(self, backend: Backend, sidecars: list[Sidecar]):
        self.backend = backend
        self.sidecar_pids = [s.proc.pid for s in sidecars]
        self.info_conn = redis.Redis.from_url(backend.target, socket_timeout=10) if backend.kind == "redis" else None

    def read(self) -> dict:
        try:
            ops = self.backend.ops(self.info_conn)
        except (OSError, KeyError, redis.RedisError) as e:
            raise PointError(f"cannot read the counters of {self.backend.target}: {e!r}") from e
        sidecars = [cpu_ticks(pid) for pid in self.sidecar_pids]
        return {
            "ops": ops,
            "backend": cpu_ticks(self.backend.pid),
            "sidecars": sum(sidecars) if sidecars and None not in sidecars else None,
        }


# --------------------------------------------------------------------------
# Running a point and summing it up.


def run_point(ctx, point: Point, meter: Meter) -> dict:
    """Starts the point's client processes, leads them through their phases,
    and returns the summary."""
    shared = Shared.create(ctx, point.procs, rule=point.workload == "contended")
    results = ctx.Queue()
    clients = [
        ctx.Process(target=client_main, args=(point, i, shared, results, os.getpid()), name=f"client-{i}", daemon=True)
        for i in range(point.procs)
    ]
    try:
        for c in clients:
            c.start()
        phase(shared, READY_TIMEOUT_S, "connect", results)
        phase(shared, point.warmup_s + WAIT_S + READY_TIMEOUT_S, "warm up", results)
        shared.reset()
        before = meter.read()
        shared.start_ns.value = time.monotonic_ns() + START_MARGIN_NS
        phase(shared, READY_TIMEOUT_S, "start", results)
        stats = collect(results, clients, point.procs, point.duration_s + WAIT_S + READY_TIMEOUT_S)
        after = meter.read()
        phase(shared, READY_TIMEOUT_S, "finish", results)
    except BaseException:
        for c in clients:  # failed or interrupted: nothing left to wait for
            if c.pid is not None:
                c.kill()
        raise
    finally:
        stop_clients(clients)
    return summarise(point, stats, before, after)


def phase(shared: Shared, timeout: float, what: str, results) -> None:
    """Meets the client processes at the barrier, or says why they did not come."""
    try:
        shared.barrier.wait(timeout)
    except threading.BrokenBarrierError:
        reasons = "; ".join(drain_fatal(results)) or f"not within {timeout:.0f} s"
        raise PointError(f"client processes did not {what}: {reasons}") from None


def drain_fatal(results) -> list[str]:
    reasons = []
    try:
        while True:
            _, stats = results.get(timeout=1)
            if "fatal" in stats:
                reasons.append(stats["fatal"])
    except queue.Empty:
        return reasons


def collect(results, clients: list, n: int, timeout: float) -> list[dict]:
    """Every client process's stats, failing fast when one fails or dies."""
    stats: dict[int, dict] = {}
    give_up = time.monotonic() + timeout
    while len(stats) < n:
        try:
            me, s = results.get(timeout=0.5)
        except queue.Empty:
            dead = [c.name for i, c in enumerate(clients) if i not in stats and c.exitcode is not None]
            if dead or time.monotonic() > give_up:
                why = f"{', '.join(dead)} exited without results" if dead else f"no results after {timeout:.0f} s"
                raise PointError(why) from None
            continue
        if "fatal" in s:
            raise PointError(s["fatal"])
        stats[me] = s
    return [stats[i] for i in range(n)]


def stop_clients(clients: list) -> None:
    give_up = time.monotonic() + STOP_TIMEOUT_S
    for c in clients:
        if c.pid is not None:
            c.join(max(0.0, give_up - time.monotonic()))
    for c in clients:
        if c.pid is not None and c.is_alive():
            c.kill()
            c.join(5)


def latency(samples_ns: list[int], unit_ns: float = 1e3) -> dict | None:
    """p50, p99 and max, in µs (or ``unit_ns``)."""
    if not samples_ns:
        return None
    s = sorted(samples_ns)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))] / unit_ns, 1)

    return {"p50": at(0.50), "p99": at(0.99), "max": at(1.0)}


def per(n: float | None, d: float) -> float | None:
    return None if n is None or d <= 0 else round(n / d, 2)


def costs(stats: list[dict], before: dict, after: dict, ops: int) -> dict:
    """Backend operations and CPU µs per operation over the measured window."""
    done = {k: after["ops"][k] - before["ops"][k] for k in after["ops"]}
    sent = [s["top_level"] for s in stats]
    if None not in sent:  # the baselines count what they send
        done["top_level"] = sum(sent)
    if "packets" in done:
        done = {"commands": done["packets"], "top_level": done["packets"]}

    def cpu_us(role: str) -> float | None:
        if before[role] is None or after[role] is None:
            return None
        return per((after[role] - before[role]) / CLK_TCK * 1e6, ops)

    return {
        "backend_ops": done,
        "commands_per_op": per(done["commands"], ops),
        "top_level_per_op": per(done["top_level"], ops),
        "cpu_us_per_op": {
            "backend": cpu_us("backend"),
            "sidecars": cpu_us("sidecars"),
            "clients": per(sum(s["cpu_s"] for s in stats) * 1e6, ops),
        },
    }


def summarise(point: Point, stats: list[dict], before: dict, after: dict) -> dict:
    errors = sum(s["errors"] for s in stats)
    first_error = next((s["first_error"] for s in stats if s["first_error"]), None)
    head = {"system": point.system, "workload": point.workload, "procs": point.procs}
    tail = {"errors": errors, "first_error": first_error}
    if point.workload == "uncontended":
        pairs = sum(len(s["acquire_ns"]) for s in stats)
        elapsed_s = max(s["elapsed_ns"] for s in stats) / 1e9
        return {
            **head,
            "pairs": pairs,
            "seconds": round(elapsed_s, 3),
            "pairs_per_s": per(pairs, elapsed_s),
            "acquire_us": latency([x for s in stats for x in s["acquire_ns"]]),
            "release_us": latency([x for s in stats for x in s["release_ns"]]),
            **costs(stats, before, after, pairs),
            **tail,
        }
    n = {k: sum(s[k] for s in stats) for k in ("grants", "late", "handoffs", "regrants", "overlaps")}
    wait = latency([x for s in stats for x in s["wait_ns"]], 1e6)
    return {
        **head,
        **n,
        "seconds": point.duration_s,
        "grants_per_s": per(n["grants"], point.duration_s),
        "handoffs_per_s": per(n["handoffs"], point.duration_s),
        "handoff_us": latency([x for s in stats for x in s["handoff_ns"]]),
        "wait_ms": wait,
        "max_wait_ms": wait and wait["max"],
        "regrant_share": round(n["regrants"] / n["grants"], 4) if n["grants"] else None,
        # Every grant in the window, the tail after the end included, is one acquire and one release.
        **costs(stats, before, after, n["grants"] + n["late"]),
        **tail,
    }


# --------------------------------------------------------------------------
# The run.


def run(args, ctx, procs: Processes, workdir: Path) -> dict:
    """Every selected point of every selected system; errors are recorded, not raised."""
    kinds = {BACKEND_OF[s] for s in args.systems}
    backends = {}
    if "redis" in kinds:
        backends["redis"] = redis_backend(procs, args.redis)
    if "zookeeper" in kinds:
        backends["zookeeper"] = zookeeper_backend(procs, workdir, args.zookeeper, args.zookeeper_pid)
    report = {
        "config": config(args, backends),
        "results": {w: [] for w in args.workloads},
        "errors": [],
    }
    run_id = secrets.token_hex(3)
    if args.server_warmup > 0:
        warm_servers(args, ctx, procs, backends, run_id, report)
    for system in args.systems:
        run_system(args, ctx, procs, system, backends[BACKEND_OF[system]], run_id, report)
    return report


def warm_servers(args, ctx, procs: Processes, backends: dict, run_id: str, report: dict) -> None:
    """Loads each JIT-compiled server with every system's workloads before anything is measured.

    ZooKeeper's JVM spends its first seconds of load interpreting and compiling
    its request path: in one run, the system measured first on a fresh server
    paid 1.3x the server CPU per pair of the same system measured second, and
    its pairs/s fell by as much. So each system on such a server runs each
    workload at its largest process count for ``--server-warmup`` seconds,
    unmeasured (errors are still reported), in the order of the measured pass.
    """
    warm = argparse.Namespace(**vars(args))
    warm.duration, warm.warmup = args.server_warmup, 0.0
    warm.procs_uncontended = [max(args.procs_uncontended)]
    warm.procs_contended = [max(args.procs_contended)]
    scratch = {"results": {w: [] for w in args.workloads}, "errors": []}
    for system in args.systems:
        if BACKEND_OF[system] in JIT_BACKENDS:
            run_system(warm, ctx, procs, system, backends[BACKEND_OF[system]], f"{run_id}w", scratch)
    report["errors"] += [f"server warm-up: {e}" for e in scratch["errors"]]


def run_system(args, ctx, procs: Processes, system: str, backend: Backend, run_id: str, report: dict) -> None:
    """The points of one system, with fresh sidecars for sidelock."""
    sidecars: list[Sidecar] = []
    try:
        if system.startswith("sidelock-"):
            for i in (0, 1):
                sidecars.append(start_sidecar(procs, args.sidelock, backend, f"{system}-{run_id}-{i}", args.sidecar_threads))
        meter = Meter(backend, sidecars)
        for workload in args.workloads:
            for n in args.procs_uncontended if workload == "uncontended" else args.procs_contended:
                print(f"[{system}] {workload}, {n} processes", file=sys.stderr, flush=True)
                # One sidecar beside the uncontended clients; contended ones alternate between two.
                urls = tuple(s.url for s in sidecars[: 1 if workload == "uncontended" else 2])
                lock = f"cp-{run_id}-{workload.replace('_', '-')}-{n}"
                point = Point(system, workload, n, args.duration, args.warmup, lock, urls or (backend.target,))
                try:
                    report["results"][workload].append(run_point(ctx, point, meter))
                except PointError as e:
                    report["errors"].append(f"{system} {workload} {n} processes: {e}")
    except SetupError as e:
        report["errors"].append(f"{system}: {e}")
    finally:
        for s in sidecars:
            procs.stop(s.proc)


def version_of(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def sidelock_version(path: Path) -> str:
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return "?"
    return out.split()[-1] if out.split() else "?"


def config(args, backends: dict[str, Backend]) -> dict:
    return {
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "server_warmup_s": args.server_warmup,
        "procs_uncontended": args.procs_uncontended,
        "procs_contended": args.procs_contended,
        "systems": args.systems,
        "workloads": args.workloads,
        "start_method": "forkserver",
        "ttl_s": TTL_S,
        "wait_s": WAIT_S,
        "redis_plain_poll_ms": POLL_S * 1e3,
        "backends": {k: {"target": b.target, "version": b.version, "pid": b.pid} for k, b in backends.items()},
        "versions": {
            "sidelock": sidelock_version(args.sidelock),
            "python": platform.python_version(),
            "redis-py": version_of("redis"),
            "python-redis-lock": version_of("python-redis-lock"),
            "kazoo": version_of("kazoo"),
        },
        "machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
    }


# --------------------------------------------------------------------------
# Output.


def cell(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if digits == 0 else f"{x:,.{digits}f}"


def p50_99(lat: dict | None) -> str:
    return "-" if lat is None else f"{cell(lat['p50'], 0)}/{cell(lat['p99'], 0)}"


def share(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def cost_cells(r: dict) -> list[str]:
    cpu = r["cpu_us_per_op"]
    return [
        cell(r["commands_per_op"], 2),
        cell(r["top_level_per_op"], 2),
        cell(cpu["backend"]),
        cell(cpu["sidecars"]),
        cell(cpu["clients"]),
    ]


def errors_cell(r: dict) -> str:
    overlaps = r.get("overlaps", 0)
    return str(r["errors"]) + (f" +{overlaps} OVERLAPS" if overlaps else "")


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |"]
    lines.append("|---|" + "---:|" * (len(header) - 1))
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


COST_HEADER = ["commands/{op}", "top-level/{op}", "backend CPU µs/{op}", "sidecars CPU µs/{op}", "clients CPU µs/{op}"]


def uncontended_table(rows: list[dict]) -> str:
    header = ["system", "procs", "pairs/s", "acquire p50/p99 µs", "release p50/p99 µs"]
    header += [h.format(op="pair") for h in COST_HEADER] + ["errors"]
    cells = [
        [r["system"], str(r["procs"]), cell(r["pairs_per_s"], 0), p50_99(r["acquire_us"]), p50_99(r["release_us"])]
        + cost_cells(r)
        + [errors_cell(r)]
        for r in rows
    ]
    return table("Uncontended (own lock per process)", header, cells)


def contended_table(rows: list[dict]) -> str:
    header = ["system", "procs", "handoffs/s", "handoff p50/p99 µs", "max wait ms"]
    header += [h.format(op="grant") for h in COST_HEADER] + ["errors"]
    cells = [
        [r["system"], str(r["procs"]), cell(r["handoffs_per_s"], 0), p50_99(r["handoff_us"]), cell(r["max_wait_ms"])]
        + cost_cells(r)
        + [errors_cell(r)]
        for r in rows
    ]
    return table("Contended (one lock, wait rule: every grant a handoff)", header, cells)


def greedy_table(rows: list[dict]) -> str:
    header = ["system", "procs", "grants/s", "regrants", "handoffs/s", "handoff p50/p99 µs", "max wait ms", "errors"]
    cells = [
        [
            r["system"],
            str(r["procs"]),
            cell(r["grants_per_s"], 0),
            share(r["regrant_share"]),
            cell(r["handoffs_per_s"], 0),
            p50_99(r["handoff_us"]),
            cell(r["max_wait_ms"]),
            errors_cell(r),
        ]
        for r in rows
    ]
    return table("Contended, greedy (no wait rule: the releaser asks again at once)", header, cells)


def render(report: dict) -> str:
    """The run as markdown: a line on the conditions, a table per workload, the errors."""
    c = report["config"]
    versions = ", ".join(f"{k} {v}" for k, v in c["versions"].items())
    servers = ", ".join(b["version"] for b in c["backends"].values())
    out = [
        f"Client processes: {c['duration_s']} s per point after {c['warmup_s']} s of warm-up "
        f"({c.get('server_warmup_s', 0)} s per system and workload on a JIT-compiled server first), "
        f"{c['machine']['cpus']} CPUs, load {c['machine']['loadavg_at_start'][0]:.2f} at the start; "
        f"{versions}; {servers}\n"
    ]
    tables = {"uncontended": uncontended_table, "contended": contended_table, "contended_greedy": greedy_table}
    out += [tables[w](rows) for w, rows in report["results"].items() if rows]
    out.append(
        "commands: everything Redis executed, scripts' commands included (ZooKeeper: packets received); "
        "top-level: what crossed the network. regrants: grants to the process that released last.\n"
    )
    if report["errors"]:
        out.append("Errors:\n" + "\n".join(f"- {e}" for e in report["errors"]) + "\n")
    return "\n".join(out)


# --------------------------------------------------------------------------
# Command line.


def counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected process counts such as 1,8, got {text!r}")
    return values


def names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        chosen = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [x for x in chosen if x not in allowed]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (got {text!r})")
        return chosen

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sidelock",
        type=Path,
        default=REPO / "target/release/sidelock",
        help="the sidelock binary (default: target/release/sidelock)",
    )
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured per point (default 5)")
    p.add_argument(
        "--sidecar-threads", type=int, help="the sidecars' --threads (default: unset, one worker per CPU)"
    )
    p.add_argument(
        "--warmup", type=float, default=1.0, help="seconds of load before each point's counters are read (default 1)"
    )
    p.add_argument(
        "--server-warmup",
        type=float,
        default=4.0,
        help="seconds of unmeasured load per workload and system on a JIT-compiled server "
        "(ZooKeeper) before the first point (default 4; 0: none)",
    )
    p.add_argument("--procs-uncontended", type=counts, default=[1, 8], help="process counts, default 1,8")
    p.add_argument(
        "--procs-contended",
        type=counts,
        default=[8, 64],
        help="process counts of both contended workloads, default 8,64",
    )
    p.add_argument("--systems", type=names(SYSTEMS), default=list(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument(
        "--workloads", type=names(WORKLOADS), default=list(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}"
    )
    p.add_argument("--redis", help="use this Redis (redis://host:port) instead of starting one")
    p.add_argument("--zookeeper", help="use this ZooKeeper (host:port, mntr allowed) instead of starting one")
    p.add_argument("--zookeeper-pid", type=int, help="its server process, for CPU readings")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.warmup < 0 or args.server_warmup < 0:
        p.error("--duration must be positive, --warmup and --server-warmup not negative")
    if any(s.startswith("sidelock-") for s in args.systems) and not os.access(args.sidelock, os.X_OK):
        p.error(f"{args.sidelock} is not an executable: cargo build --release --bins, or give --sidelock")
    return args


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ctx = mp.get_context("forkserver")
    # What every client process imports, imported once in the forkserver.
    ctx.set_forkserver_preload(["http.client", "redis", "redis_lock", "kazoo.client"])
    workdir = Path(tempfile.mkdtemp(prefix="client-procs-"))
    procs = Processes(workdir)
    try:
        report = run(args, ctx, procs, workdir)
    except SetupError as e:
        print(f"client_procs: {e}\n(logs in {workdir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("client_procs: interrupted", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    if report["errors"]:
        print(f"client_procs: {len(report['errors'])} error(s); logs in {workdir}", file=sys.stderr)
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
