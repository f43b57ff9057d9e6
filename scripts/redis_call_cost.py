"""Redis's own CPU per uncontended acquire + release, without a sidecar.

Sends, pipelined 64 at a time so that the client's speed does not matter,
the two script calls sidelock makes for one uncontended pair (its real
scripts, keys and arguments, as `MONITOR` shows them), the same calls to
no-op scripts (what the call itself costs), and the direct client's pair
(`SET NX PX` and the owner-checked release script). Prints the server's CPU
per pair (`/proc/<pid>/stat`, so Redis must run on this machine) and its
`usec_per_call` for `EVALSHA`. Point it at a throwaway server: it empties
db 0 before each measurement.

    redis-server --port 16380 --save '' --daemonize yes
    python scripts/redis_call_cost.py 16380

With `--callgrind`, for a server run under
`valgrind --tool=callgrind redis-server --port 16380 --save ''`, it prints
the server's instructions per pair instead, which do not depend on the
machine's load (fewer pairs: callgrind runs the server some 50 times
slower).
"""

import glob
import pathlib
import subprocess
import sys
import threading
import time
import uuid

import redis

LUA = pathlib.Path(__file__).resolve().parent.parent / "src/backend/redis"
RELEASE_LUA = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end"
)
PAIRS, BATCH = 40_000, 64
OWNER, SIDECAR = "anonymous-e1bd4f8395a6", "vm-67353f"


def full_script(fast, body):
    """As `fast_script` in src/backend/redis/scripts.rs (`handing_script` for the release):
    lean part, fast head, the queue's helpers (then the release's handoff), prelude, body."""
    read = lambda name: (LUA / name).read_text()
    if fast == "release_fast.lua":
        return (f"{read('lean.lua')}\n{read(fast)}\n{read('hand_over.lua')}\n"
                f"{read('release_handing.lua')}\n{read('prelude.lua')}\n{read(body)}")
    return f"{read('lean.lua')}\n{read(fast)}\n{read('hand_over.lua')}\n{read('prelude.lua')}\n{read(body)}"


def key(n):
    return f"sidelock:bench-{n:04d}"


def acquire_args(n, token):
    """An uncontended try-once exclusive acquire with a 30 s ttl, as the sidecar sends it
    (without the trailing arguments at their defaults)."""
    spec = f'30000 0 0 ["{OWNER}","{SIDECAR}"]'
    return [1, key(n), "l", "o", "x", token, spec, "30000", "0", f'["{OWNER}",', SIDECAR]


def release_args(n, token):
    return [1, key(n), "l", token, "1", SIDECAR, "sidelock:/sidecars/"]


def run_pairs(r, label, acquire, release):
    """Runs PAIRS pairs (the caller empties the db); `acquire`/`release` add one call
    each to a pipeline and are (step, check of its reply)."""
    for _ in range(0, PAIRS, BATCH):
        tokens = [uuid.uuid4().hex for _ in range(BATCH)]
        for step, answered in (acquire, release):
            pipe = r.pipeline(transaction=False)
            for n, token in enumerate(tokens):
                step(pipe, n, token)
            for reply in pipe.execute():
                assert answered(reply), f"{label}: unexpected reply {reply!r}"


def measure(r, pid, label, acquire, release):
    """Prints the server's CPU per pair over PAIRS pairs."""

    def cpu():
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    r.flushdb()
    r.config_resetstat()
    before = cpu()
    run_pairs(r, label, acquire, release)
    used_us = (cpu() - before) * 1e6 / 100  # clock ticks of 10 ms
    evalsha = r.info("commandstats").get("cmdstat_evalsha", {}).get("usec_per_call", 0)
    print(f"{label:34} {used_us / PAIRS:6.1f} µs per pair   EVALSHA {evalsha:5.2f} µs per call")


def count(r, pid, label, acquire, release):
    """Prints the server's instructions per pair (callgrind) over PAIRS pairs."""

    def control(*args):
        # valgrind takes a request only while the server runs: ping meanwhile.
        done = threading.Event()

        def ping():
            other = redis.Redis(port=r.connection_pool.connection_kwargs["port"])
            while not done.is_set():
                other.ping()
                time.sleep(0.05)

        pinger = threading.Thread(target=ping)
        pinger.start()
        subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)
        done.set()
        pinger.join()

    r.flushdb()
    run_pairs(r, label, acquire, release)  # warm-up
    r.flushdb()
    control("-z")
    run_pairs(r, label, acquire, release)
    # A hint that starts with a digit would be taken for a process id.
    hint = f"pairs-{uuid.uuid4().hex}"
    control("-d", hint)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for dump in glob.glob(f"/proc/{pid}/cwd/callgrind.out.{pid}*"):
            text = pathlib.Path(dump).read_text(errors="replace")
            if f"Trigger: dump {hint}\n" in text:
                total = int(next(l for l in text.splitlines() if l.startswith("summary:")).split()[1])
                print(f"{label:34} {total / PAIRS:9,.0f} instructions per pair")
                return
        time.sleep(0.1)
    sys.exit(f"no callgrind dump for {label}: is the server run under valgrind --tool=callgrind?")


def main():
    global PAIRS, BATCH
    args = [a for a in sys.argv[1:] if a != "--callgrind"]
    if len(args) != 1:
        sys.exit(__doc__)
    port = int(args[0])
    measure = globals()["measure"]
    if "--callgrind" in sys.argv:
        PAIRS, BATCH, measure = 4_000, 50, count
    r = redis.Redis(port=port)
    pid = int(r.info("server")["process_id"])
    acquire = r.script_load(full_script("acquire_fast.lua", "acquire.lua"))
    release = r.script_load(full_script("release_fast.lua", "release.lua"))
    noop_acquire = r.script_load("return {1}")
    noop_release = r.script_load("return {0, 0}")
    direct_release = r.script_load(RELEASE_LUA)
    # Each step with the check of its reply: sidelock's fast paths answer a
    # grant with the lease's value and a release that leaves nothing with 0.
    measure(r, pid, "sidelock's scripts",
            (lambda p, n, t: p.evalsha(acquire, *acquire_args(n, t)), lambda a: isinstance(a, bytes)),
            (lambda p, n, t: p.evalsha(release, *release_args(n, t)), lambda a: a == 0))
    measure(r, pid, "no-op scripts, same arguments",
            (lambda p, n, t: p.evalsha(noop_acquire, *acquire_args(n, t)), lambda a: a == [1]),
            (lambda p, n, t: p.evalsha(noop_release, *release_args(n, t)), lambda a: a == [0, 0]))
    measure(r, pid, "direct: SET NX PX + release script",
            (lambda p, n, t: p.set(key(n), t, nx=True, px=30_000), lambda a: a is True),
            (lambda p, n, t: p.evalsha(direct_release, 1, key(n), t), lambda a: a == 1))


if __name__ == "__main__":
    main()
