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
"""

import pathlib
import sys
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
    lean part, fast head, the queue's helpers, prelude, body."""
    read = lambda name: (LUA / name).read_text()
    if fast == "release_fast.lua":
        return f"{read('lean.lua')}\n{read('hand_over.lua')}\n{read(fast)}\n{read('prelude.lua')}\n{read(body)}"
    return f"{read('lean.lua')}\n{read(fast)}\n{read('hand_over.lua')}\n{read('prelude.lua')}\n{read(body)}"


def key(n):
    return f"sidelock:bench-{n:04d}"


def acquire_args(n, token):
    """An uncontended try-once exclusive acquire with a 30 s ttl, as the sidecar sends it."""
    spec = f'30000 0 0 ["{OWNER}","{SIDECAR}"]'
    return [1, key(n), "l", "o", "x", token, spec, "30000", "0", f'["{OWNER}",', SIDECAR,
            "", "0", "0", "0", "1", "0"]


def release_args(n, token):
    return [1, key(n), "l", token, "1", SIDECAR, "sidelock:/sidecars/"]


def measure(r, pid, label, acquire, release):
    """Runs PAIRS pairs; `acquire`/`release` add one call each to a pipeline."""

    def cpu():
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    r.flushdb()
    r.config_resetstat()
    before = cpu()
    for _ in range(0, PAIRS, BATCH):
        tokens = [uuid.uuid4().hex for _ in range(BATCH)]
        for step in (acquire, release):
            pipe = r.pipeline(transaction=False)
            for n, token in enumerate(tokens):
                step(pipe, n, token)
            for reply in pipe.execute():
                # Granted (`SET` → True, scripts → {1, …}), then released
                # (1, or {0, 0}: released, no holds left).
                granted = reply is True or (isinstance(reply, list) and reply[:1] == [1])
                released = reply == 1 or reply == [0, 0]
                assert granted or released, f"{label}: unexpected reply {reply!r}"
    used_us = (cpu() - before) * 1e6 / 100  # clock ticks of 10 ms
    evalsha = r.info("commandstats").get("cmdstat_evalsha", {}).get("usec_per_call", 0)
    print(f"{label:34} {used_us / PAIRS:6.1f} µs per pair   EVALSHA {evalsha:5.2f} µs per call")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    port = int(sys.argv[1])
    r = redis.Redis(port=port)
    pid = int(r.info("server")["process_id"])
    acquire = r.script_load(full_script("acquire_fast.lua", "acquire.lua"))
    release = r.script_load(full_script("release_fast.lua", "release.lua"))
    noop_acquire = r.script_load("return {1}")
    noop_release = r.script_load("return {0, 0}")
    direct_release = r.script_load(RELEASE_LUA)
    measure(r, pid, "sidelock's scripts",
            lambda p, n, t: p.evalsha(acquire, *acquire_args(n, t)),
            lambda p, n, t: p.evalsha(release, *release_args(n, t)))
    measure(r, pid, "no-op scripts, same arguments",
            lambda p, n, t: p.evalsha(noop_acquire, *acquire_args(n, t)),
            lambda p, n, t: p.evalsha(noop_release, *release_args(n, t)))
    measure(r, pid, "direct: SET NX PX + release script",
            lambda p, n, t: p.set(key(n), t, nx=True, px=30_000),
            lambda p, n, t: p.evalsha(direct_release, 1, key(n), t))


if __name__ == "__main__":
    main()
