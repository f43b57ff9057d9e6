"""The chart's rendered configuration, run by the real sidelock binary.

The sidecar container and the example application of a rendering are started
as local processes, the way the kubelet would start them: the sidecar with the
container's args, its env resolved (secretKeyRef from the rendered Secret,
fieldRef from a pod name) and sidelock.toml from the ConfigMap; the example
application's shell loop with its env. Only the listen address is changed to
127.0.0.1:0, and the probes are sent to the paths the container declares.

Needs the binary: target/debug/sidelock (scripts/test.sh builds it before the
chart tests), target/release/sidelock, or $SIDELOCK_BIN.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from conftest import CHART_DIR, REPO, find_container, manifests, one, pod_spec, render_chart
from test_chart import EXAMPLE_ON, METRICS_IN_ALERTS, deep_merge, load_yaml

POD = "demo-sidelock-example-7d9f-abcde"


def sidelock_binary() -> Path | None:
    candidates = [os.environ.get("SIDELOCK_BIN"), REPO / "target/debug/sidelock", REPO / "target/release/sidelock"]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    return None


BINARY = sidelock_binary()


@pytest.fixture(autouse=True)
def require_binary() -> None:
    """These tests need the real binary; without it they fail, never skip."""
    if BINARY is None:
        pytest.fail("sidelock binary not built: run scripts/test.sh (it builds it) or cargo build --bins")
    for tool in ("curl", "sh"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run scripts/setup.sh")


def resolve_env(container: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """A container's env as the kubelet would resolve it."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        source = e["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[e["name"]] = secrets[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name"
            env[e["name"]] = POD
        else:
            raise AssertionError(f"unexpected env source {source}")
    return env


class Sidecar:
    def __init__(self, rendered: dict[str, str], tmp: Path, secrets: dict[str, dict[str, str]] | None = None):
        objects = manifests(rendered)
        self.objects = objects
        self.secrets = dict(secrets or {})
        for s in objects:
            if s["kind"] == "Secret":
                self.secrets[s["metadata"]["name"]] = {
                    k: base64.b64decode(v).decode() for k, v in s["data"].items()}
        self.spec = pod_spec(one(objects, "Deployment"))
        _, self.container = find_container(self.spec, "sidelock")
        toml = one(objects, "ConfigMap")["data"]["sidelock.toml"]
        toml, n = re.subn(r'(?m)^listen = .*$', 'listen = "127.0.0.1:0"', toml)
        assert n == 1
        config = tmp / "sidelock.toml"
        config.write_text(toml)
        args = [str(config) if a == "/etc/sidelock/sidelock.toml" else a for a in self.container["args"]]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        env.update(resolve_env(self.container, self.secrets))
        self.env = env
        self.stderr = tmp / "sidelock.stderr"
        self.proc = subprocess.Popen([str(BINARY), *args], env=env, stdout=subprocess.DEVNULL,
                                     stderr=self.stderr.open("w"))
        deadline = time.monotonic() + 20
        while True:
            m = re.search(r"listening on (127\.0\.0\.1:\d+)", self.stderr.read_text())
            if m:
                self.url = f"http://{m.group(1)}"
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"sidelock did not start: {self.stderr.read_text()}")
            time.sleep(0.05)

    def request(self, method: str, path: str, token: str | None = None,
                host: str | None = None) -> tuple[int, str]:
        req = urllib.request.Request(self.url + path, method=method)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if host:
            req.add_header("Host", host)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture
def sidecar(chart: helm.Chart, tmp_path: Path, request: pytest.FixtureRequest):
    values = deep_merge(EXAMPLE_ON, getattr(request, "param", {}))
    s = Sidecar(render_chart(chart, values), tmp_path)
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


SCENARIOS = {
    "defaults": {},
    "ci/memory-values.yaml": load_yaml(CHART_DIR / "ci" / "memory-values.yaml"),
    "durations-in-ms-no-admin": {"config": {"defaultTtl": 15000, "maxTtl": "1m30s", "lockDelay": "250ms",
                                            "logFormat": "text"},
                                 "auth": {"adminEnabled": False}},
    "caps-and-timeouts": {"config": {"maxTotalWaiters": 7, "maxHeld": 9, "maxConnections": 500,
                                     "headerReadTimeout": "3s", "idleTimeout": 4000,
                                     "bodyReadTimeout": "5s", "dashboardSessionTtl": "1h"}},
}


@pytest.mark.parametrize("sidecar", SCENARIOS.values(), ids=SCENARIOS.keys(), indirect=True)
def test_sidecar_runs_with_the_chart_config(sidecar: Sidecar) -> None:
    c = sidecar.container
    # The probes the kubelet would send.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        status, _ = sidecar.request("GET", c[probe]["httpGet"]["path"])
        assert status == 200, probe

    api = sidecar.env["SIDELOCK_API_TOKEN"]
    status, _ = sidecar.request("GET", "/v1/info")
    assert status == 401, "the pod-IP listener must require the API token"
    status, body = sidecar.request("GET", "/v1/info", api)
    assert status == 200
    info = json.loads(body)
    assert info["sidecar"] == POD  # SIDELOCK_SIDECAR_ID from the downward API
    assert info["auth"] == {"api_token": True, "admin_token": "SIDELOCK_ADMIN_TOKEN" in sidecar.env}

    # The config file's values are the ones in effect.
    toml = one(sidecar.objects, "ConfigMap")["data"]["sidelock.toml"]
    default_ttl = re.search(r'default_ttl = "(\d+)(ms|s|m|h)"', toml)
    factor = {"ms": 1, "s": 1000, "m": 60000, "h": 3600000}[default_ttl.group(2)]
    assert info["limits"]["default_ttl_ms"] == int(default_ttl.group(1)) * factor
    for key in ("max_total_waiters", "max_held"):
        assert info["limits"][key] == int(re.search(rf"^{key} = (\d+)$", toml, re.M).group(1)), key

    # The admin token reaches the sidecar when enabled.
    admin = sidecar.env.get("SIDELOCK_ADMIN_TOKEN")
    status, _ = sidecar.request("DELETE", "/v1/admin/locks/anything", admin or api)
    assert status == (200 if admin else 403)

    status, _ = sidecar.request("GET", "/metrics")
    assert status == 200
    assert sidecar.stop() == 0


@pytest.mark.parametrize("sidecar", [{"sidecar": {"allowedHosts": ["demo.pods.internal"]}}], indirect=True)
def test_probes_and_scrapes_by_pod_ip(sidecar: Sidecar) -> None:
    """Kubelets and Prometheus call the sidecar by pod IP: the probe paths the
    container declares and the metrics Service's /metrics answer whatever the
    Host; the API refuses a Host that is not loopback (421) unless
    sidecar.allowedHosts names it."""
    c = sidecar.container
    pod_ip = f"10.1.2.3:{c['ports'][0]['containerPort']}"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        status, _ = sidecar.request("GET", c[probe]["httpGet"]["path"], host=pod_ip)
        assert status == 200, probe
    svc = next(o for o in sidecar.objects if o["kind"] == "Service")
    assert svc["spec"]["ports"][0]["name"] == "http-metrics"
    status, _ = sidecar.request("GET", "/metrics", host=pod_ip)
    assert status == 200
    api = sidecar.env["SIDELOCK_API_TOKEN"]
    status, body = sidecar.request("GET", "/v1/info", api, host=pod_ip)
    assert status == 421, body
    assert "urn:sidelock:problem:misdirected-request" in body
    status, _ = sidecar.request("GET", "/v1/info", api, host="demo.pods.internal:7070")
    assert status == 200
    status, _ = sidecar.request("GET", "/v1/info", api)
    assert status == 200, "the application calls 127.0.0.1"
    assert sidecar.stop() == 0


def test_alert_metrics_exist(sidecar: Sidecar) -> None:
    """Every metric the PrometheusRule uses is exported under that name."""
    api = sidecar.env["SIDELOCK_API_TOKEN"]
    # A lease that expires (lost, reason expired), and a waiter on a held lock.
    assert sidecar.request("POST", "/v1/locks/expiring?ttl=100ms", api)[0] == 200
    assert sidecar.request("POST", "/v1/locks/busy?ttl=5s", api)[0] == 200
    waiter = threading.Thread(target=sidecar.request, args=("POST", "/v1/locks/busy?wait=1s", api))
    waiter.start()
    time.sleep(0.5)
    _, metrics = sidecar.request("GET", "/metrics")
    waiter.join()
    names = set(re.findall(r"^(sidelock_[a-z_]+)", metrics, re.M))
    assert METRICS_IN_ALERTS <= names, METRICS_IN_ALERTS - names
    assert re.search(r'^sidelock_lost_total\{reason="expired"\} [1-9]', metrics, re.M)
    assert sidecar.stop() == 0


def test_example_application_script_works(sidecar: Sidecar) -> None:
    """The example Deployment's shell loop, run against the sidecar."""
    _, app = find_container(sidecar.spec, "app")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    env.update(resolve_env(app, sidecar.secrets))
    assert env["SIDELOCK_URL"] == "http://127.0.0.1:7070"
    env["SIDELOCK_URL"] = sidecar.url
    env["HOLD_SECONDS"] = "0"
    proc = subprocess.Popen(app["command"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3)
    finally:
        proc.kill()
    out = proc.communicate()[0]
    assert "acquired example fence=1;" in out, out
    assert "released example fence=1" in out, out
    assert "acquired example fence=2;" in out, out
    assert "failed" not in out, out
    assert sidecar.stop() == 0
