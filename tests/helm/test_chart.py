"""Tests of the sidelock Helm chart (helm/sidelock), the container image
definition and the sidecar injection into an application chart.

Run: .venv/bin/pytest tests/helm -q   (tests/helm/run.sh sets up .venv).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import re
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from conftest import (
    CHART_DIR,
    CRD_KINDS,
    NAMESPACE,
    RELEASE,
    REPO,
    by_kind,
    find_container,
    manifests,
    one,
    pod_metadata,
    pod_spec,
    render_chart,
    validate_k8s,
)

FULLNAME = f"{RELEASE}-sidelock"
# The example Deployment carries the injected sidecar in the rendering tests;
# it is off by default, so they turn it on.
EXAMPLE_ON: dict[str, Any] = {"example": {"enabled": True}}
CI_VALUES = sorted((CHART_DIR / "ci").glob("*-values.yaml"))

# The config keys sidelock reads from sidelock.toml (its flag names in snake_case).
CONFIG_KEYS = {
    "listen", "backend", "default_ttl", "max_ttl", "max_wait", "lock_delay",
    "stale_after", "max_waiters", "metrics_lock_labels", "shutdown_grace",
    "log_format", "sidecar_id", "allowed_hosts", "max_total_waiters", "max_held",
    "max_connections", "header_read_timeout", "idle_timeout", "body_read_timeout",
    "write_timeout", "dashboard_session_ttl",
}
DURATION = re.compile(r"^([0-9]+(ms|s|m|h))+$")
PROM_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
METRICS_IN_ALERTS = {
    "sidelock_backend_up", "sidelock_lost_total", "sidelock_stale_locks",
    "sidelock_wait_seconds_bucket", "sidelock_waiters",
}


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of user values over defaults (null deletes a key)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def seconds(duration: str | int) -> float:
    if isinstance(duration, int):
        return duration / 1000
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(int(n) * units[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h)", duration))


# --------------------------------------------------------------------------
# Checks shared by the scenarios
# --------------------------------------------------------------------------


def check_sidecar(
    spec: dict[str, Any],
    values: dict[str, Any],
    *,
    secret: str,
    configmap: str,
) -> dict[str, Any]:
    """The injected sidecar in a pod spec: placement, probes, ports, security
    context, configuration volume, and every secret from a Secret."""
    sc = values["sidecar"]
    field, c = find_container(spec, sc["containerName"])

    # Native sidecar = init container with restartPolicy Always; else a plain container.
    if sc["native"]:
        assert field == "initContainers"
        assert c.get("restartPolicy") == "Always"
    else:
        assert field == "containers"
        assert "restartPolicy" not in c

    assert c["image"].startswith(values["image"]["repository"])
    assert c["args"][:3] == ["serve", "--config", "/etc/sidelock/sidelock.toml"]

    # Port and probes.
    assert c["ports"] == [{"name": "sidelock", "containerPort": sc["port"], "protocol": "TCP"}]
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert c[probe]["httpGet"] == {"path": path, "port": "sidelock", "scheme": "HTTP"}, probe
        assert c[probe]["periodSeconds"] >= 1

    # Security context.
    sec = c["securityContext"]
    assert sec["runAsNonRoot"] is True
    assert sec["runAsUser"] != 0
    assert sec["readOnlyRootFilesystem"] is True
    assert sec["allowPrivilegeEscalation"] is False
    assert sec.get("privileged", False) is False
    assert sec["capabilities"]["drop"] == ["ALL"]
    assert sec["seccompProfile"] == {"type": "RuntimeDefault"}

    # Resources: requests and limits.
    assert c["resources"]["requests"]["memory"]
    assert c["resources"]["requests"]["cpu"]
    assert c["resources"]["limits"]["memory"]

    # Environment: tokens from the Secret, sidecar id from the downward API,
    # nothing secret as a literal value.
    env = {e["name"]: e for e in c["env"]}
    assert env["SIDELOCK_SIDECAR_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["SIDELOCK_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": secret, "key": values["auth"]["apiTokenKey"]}
    if values["auth"]["adminEnabled"]:
        assert env["SIDELOCK_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": secret, "key": values["auth"]["adminTokenKey"]}
    else:
        assert "SIDELOCK_ADMIN_TOKEN" not in env
    from_secret = values["backend"]["urlFromSecret"]
    if from_secret["name"]:
        assert env["SIDELOCK_BACKEND"]["valueFrom"]["secretKeyRef"] == from_secret
    else:
        assert "SIDELOCK_BACKEND" not in env
    for name, e in env.items():
        if "TOKEN" in name or name == "SIDELOCK_BACKEND":
            assert "value" not in e, f"{name} must come from a Secret"

    # Config volume from the ConfigMap.
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/sidelock")
    assert mount["readOnly"] is True
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == configmap

    # Long enough to release the locks on SIGTERM.
    assert spec["terminationGracePeriodSeconds"] >= seconds(values["config"]["shutdownGrace"]) + 5
    return c


def check_config(cm: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    text = cm["data"]["sidelock.toml"]
    config = tomllib.loads(text)
    assert set(config) <= CONFIG_KEYS, set(config) - CONFIG_KEYS
    host = values["sidecar"]["listenHost"]
    host = f"[{host}]" if ":" in host else host
    assert config["listen"] == f"{host}:{values['sidecar']['port']}"
    if values["backend"]["urlFromSecret"]["name"]:
        assert "backend" not in config
    else:
        assert config["backend"] == values["backend"]["url"]
    for key in ("default_ttl", "max_ttl", "max_wait", "lock_delay", "stale_after", "shutdown_grace",
                "header_read_timeout", "idle_timeout", "body_read_timeout", "write_timeout",
                "dashboard_session_ttl"):
        assert DURATION.match(config[key]), (key, config[key])
    for key in ("max_waiters", "max_total_waiters", "max_held", "max_connections"):
        assert isinstance(config[key], int), key
    assert isinstance(config["metrics_lock_labels"], bool)
    assert config["log_format"] in ("json", "text")
    return config


def check_service_monitor(sm: dict[str, Any], svc: dict[str, Any]) -> None:
    """ServiceMonitor is a CRD that kubernetes-validate cannot check: the
    structure the Prometheus Operator needs is checked here."""
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["namespace"] == NAMESPACE
    assert set(sm["spec"]) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}
    match = sm["spec"]["selector"]["matchLabels"]
    assert match.items() <= svc["metadata"]["labels"].items(), "ServiceMonitor must select the metrics Service"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["endpoints"], "at least one endpoint"
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in port_names
        assert ep["path"] == "/metrics"
        assert ep["scheme"] == "http"
        assert PROM_DURATION.match(ep["interval"]) and PROM_DURATION.match(ep["scrapeTimeout"])
        assert seconds(ep["scrapeTimeout"]) <= seconds(ep["interval"])


def check_prometheus_rule(rule: dict[str, Any]) -> list[dict[str, Any]]:
    """PrometheusRule is a CRD: check the structure the operator accepts, and
    that the alerts use sidelock's metric names."""
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    groups = rule["spec"]["groups"]
    assert isinstance(groups, list) and groups
    rules = []
    for group in groups:
        assert set(group) <= {"name", "interval", "rules", "limit", "partial_response_strategy"}
        assert isinstance(group["name"], str) and group["name"]
        assert isinstance(group["rules"], list)
        for r in group["rules"]:
            assert ("alert" in r) != ("record" in r)
            assert set(r) <= {"alert", "record", "expr", "for", "labels", "annotations", "keep_firing_for"}
            assert isinstance(r["expr"], str) and r["expr"].strip()
            assert "{{" not in r["expr"], "Go template left in a PromQL expression"
            assert r["expr"].count("(") == r["expr"].count(")")
            assert r["expr"].count("{") == r["expr"].count("}")
            if "alert" in r:
                assert re.match(r"^[A-Z][A-Za-z0-9]+$", r["alert"])
                assert r["labels"]["severity"]
                assert r["annotations"]["summary"] and r["annotations"]["description"]
                if "for" in r:
                    assert PROM_DURATION.match(r["for"])
            rules.append(r)
    return rules


# --------------------------------------------------------------------------
# Chart metadata and values
# --------------------------------------------------------------------------


def test_chart_metadata(chart: helm.Chart, chart_values: dict[str, Any]) -> None:
    meta = chart.metadata
    assert meta["apiVersion"] == "v2"
    assert meta["name"] == "sidelock"
    assert chart.schema is not None
    # The image tag is spelled out in values (the named templates run inside
    # application charts, whose .Chart is not ours): it must follow appVersion.
    assert chart_values["image"]["tag"] == meta["appVersion"]


def test_default_values_pass_the_schema(chart: helm.Chart, chart_values: dict[str, Any]) -> None:
    chart.validate_schema(chart_values)


def _values_lines() -> list[str]:
    return (CHART_DIR / "values.yaml").read_text().splitlines()


def _documented_paths() -> tuple[set[str], set[str]]:
    """(all key paths, key paths preceded by a `# --` comment) of values.yaml."""
    paths, documented = set(), set()
    stack: list[tuple[int, str]] = []
    comment = False
    for line in _values_lines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = True
            continue
        if stripped.startswith("#"):
            continue
        if not stripped:
            comment = False
            continue
        m = re.match(r"^( *)([A-Za-z0-9_]+):", line)
        if not m:
            continue  # list items
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        path = ".".join(k for _, k in stack)
        paths.add(path)
        if comment:
            documented.add(path)
        comment = False
    return paths, documented


def _leaves(values: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += _leaves(value, path + ".")
        else:
            out.append(path)
    return out


def test_every_value_is_commented_in_values_yaml(chart_values: dict[str, Any]) -> None:
    _, documented = _documented_paths()
    undocumented = [
        leaf for leaf in _leaves(chart_values)
        if not any(leaf == d or leaf.startswith(d + ".") for d in documented)
    ]
    assert not undocumented, f"values without a '# --' comment: {undocumented}"


def test_readme_lists_every_value(chart_values: dict[str, Any]) -> None:
    readme = (CHART_DIR / "README.md").read_text()
    _, documented = _documented_paths()
    missing = [p for p in sorted(documented) if f"`{p}`" not in readme]
    assert not missing, f"README.md does not document: {missing}"
    # ...and documents nothing that does not exist.
    values_section = readme.split("\n## Values\n", 1)[1]
    table_keys = set(re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", values_section, re.M))
    assert table_keys == documented, table_keys ^ documented


# --------------------------------------------------------------------------
# helm lint --strict
# --------------------------------------------------------------------------


def _lint_problems(report: dict[str, Any]) -> list[str]:
    # severity: 1 info, 2 warning, 3 error; --strict fails on warnings.
    return [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2] + report["errors"]


def test_lint_strict_default_values() -> None:
    report = helm.lint(CHART_DIR, strict=True, kube_version="v1.29.0")
    assert report["total_charts_linted"] == 1
    assert _lint_problems(report) == []


def test_ci_values_cover_every_backend() -> None:
    names = {p.name for p in CI_VALUES}
    assert {f"{b}-values.yaml" for b in ("memory", "redis", "redlock", "zk", "postgres")} <= names
    schemes = {load_yaml(p)["backend"]["url"].split("://")[0] for p in CI_VALUES}
    assert schemes >= {"memory", "redis", "redlock", "zk", "postgres"}


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_lint_strict_ci_values(values_file: Path) -> None:
    report = helm.lint(CHART_DIR, load_yaml(values_file), strict=True, kube_version="v1.29.0")
    assert _lint_problems(report) == []


def test_lint_reports_schema_violations() -> None:
    report = helm.lint(CHART_DIR, {"backend": {"url": "http://redis:6379"}}, strict=True)
    assert any("/backend/url" in e for e in report["errors"]), report


# --------------------------------------------------------------------------
# Rendering scenarios, validated against the Kubernetes 1.29 schemas
# --------------------------------------------------------------------------

SCENARIOS: dict[str, dict[str, Any]] = {
    "default-native": {},
    "non-native": {"sidecar": {"native": False}},
    "existing-secret": {"auth": {"existingSecret": "team-sidelock-tokens", "apiTokenKey": "api", "adminTokenKey": "admin"}},
    "no-admin-token": {"auth": {"adminEnabled": False}},
    "backend-url-from-secret": {"backend": {"url": "postgres://db:5432/locks", "urlFromSecret": {"name": "pg-url", "key": "url"}}},
    "monitoring-on": {"metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}},
    "monitoring-off": {"metrics": {"serviceMonitor": {"enabled": False}, "prometheusRule": {"enabled": False}}},
    "ipv6-digest-durations-in-ms": {
        "sidecar": {"listenHost": "::", "port": 7171},
        "image": {"digest": "sha256:" + "a" * 64},
        "config": {"defaultTtl": 15000, "shutdownGrace": "20s", "lockDelay": "1m30s"},
    },
    **{f"ci/{p.name}": load_yaml(p) for p in CI_VALUES},
}


@pytest.fixture(scope="module", params=sorted(SCENARIOS), ids=str)
def scenario(request: pytest.FixtureRequest, chart: helm.Chart, chart_values: dict[str, Any]):
    overrides = deep_merge(EXAMPLE_ON, SCENARIOS[request.param])
    values = deep_merge(chart_values, overrides)
    rendered = render_chart(chart, overrides, api_versions=["monitoring.coreos.com/v1"])
    return request.param, values, rendered, manifests(rendered)


def test_scenario_manifests_validate_against_kubernetes_1_29(scenario) -> None:
    _, _, _, objects = scenario
    assert objects
    for obj in objects:
        assert obj["metadata"]["namespace"] == NAMESPACE
        if obj["kind"] in CRD_KINDS:
            continue  # checked structurally below
        validate_k8s(obj)


def test_scenario_sidecar(scenario) -> None:
    _, values, _, objects = scenario
    secret = values["auth"]["existingSecret"] or FULLNAME
    cm = one(objects, "ConfigMap")
    deployment = one(objects, "Deployment")
    spec = pod_spec(deployment)
    check_sidecar(spec, values, secret=secret, configmap=cm["metadata"]["name"])
    check_config(cm, values)

    # The example application talks to its sidecar over loopback with the API token.
    _, app = find_container(spec, "app")
    env = {e["name"]: e for e in app["env"]}
    host = "[::1]" if ":" in values["sidecar"]["listenHost"] else "127.0.0.1"
    assert env["SIDELOCK_URL"]["value"] == f"http://{host}:{values['sidecar']['port']}"
    assert env["SIDELOCK_API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == secret
    assert app["securityContext"]["runAsNonRoot"] is True

    # The config checksum rolls the pods when the configuration changes.
    digest = pod_metadata(deployment)["annotations"]["checksum/sidelock-config"]
    assert digest == hashlib.sha256(cm["data"]["sidelock.toml"].rstrip("\n").encode()).hexdigest()


def test_scenario_secret(scenario) -> None:
    _, values, _, objects = scenario
    secrets = by_kind(objects, "Secret")
    if values["auth"]["existingSecret"]:
        assert secrets == [], "no Secret is created when an existing one is named"
        return
    (secret,) = secrets
    assert secret["metadata"]["name"] == FULLNAME
    keys = {values["auth"]["apiTokenKey"]}
    if values["auth"]["adminEnabled"]:
        keys.add(values["auth"]["adminTokenKey"])
    assert set(secret["data"]) == keys
    for key, encoded in secret["data"].items():
        assert len(base64.b64decode(encoded)) >= 32, f"generated {key} is too short"


def test_scenario_metrics(scenario) -> None:
    _, values, _, objects = scenario
    svc = one(objects, "Service")
    deployment = one(objects, "Deployment")
    assert svc["metadata"]["name"] == f"{FULLNAME}-metrics"
    assert svc["spec"]["selector"].items() <= pod_metadata(deployment)["labels"].items(), \
        "metrics Service must select the pods that carry the sidecar"
    (port,) = svc["spec"]["ports"]
    assert port["name"] == "http-metrics"
    assert port["targetPort"] == "sidelock"

    monitoring = values["metrics"]
    sms = by_kind(objects, "ServiceMonitor")
    rules = by_kind(objects, "PrometheusRule")
    assert len(sms) == (1 if monitoring["serviceMonitor"]["enabled"] else 0)
    assert len(rules) == (1 if monitoring["prometheusRule"]["enabled"] else 0)
    for sm in sms:
        check_service_monitor(sm, svc)
    for rule in rules:
        alerts = check_prometheus_rule(rule)
        exprs = " ".join(a["expr"] for a in alerts)
        for metric in METRICS_IN_ALERTS:
            assert metric in exprs, f"no alert on {metric}"
        assert f'job="{FULLNAME}-metrics"' in exprs
        lost = next(a for a in alerts if a["alert"] == "SidelockLeaseLost")
        assert 'reason!="shutdown"' in lost["expr"]


def test_no_secret_outside_the_secret(chart: helm.Chart) -> None:
    """Tokens given in values end up only in the Secret: not in the ConfigMap,
    not as literals in the pod spec, not in NOTES."""
    api, admin = "api-TOKEN-1234567890abcdef", "admin-TOKEN-1234567890abcdef"
    rendered = render_chart(chart, {"auth": {"apiToken": api, "adminToken": admin}})
    for path, text in rendered.items():
        hits = [t for t in (api, admin) if t in text or base64.b64encode(t.encode()).decode() in text]
        if path.endswith("templates/secret.yaml"):
            assert len(hits) == 2
        else:
            assert hits == [], f"token leaked into {path}"
    secret = one(manifests(rendered), "Secret")
    assert base64.b64decode(secret["data"]["api-token"]).decode() == api
    assert base64.b64decode(secret["data"]["admin-token"]).decode() == admin


def test_prometheus_rule_options(chart: helm.Chart) -> None:
    rendered = render_chart(chart, {"metrics": {"prometheusRule": {
        "enabled": True,
        "selector": 'cluster="eu-1",job="sidelock"',
        "alertLabels": {"team": "payments"},
        "alerts": {"backendDown": {"enabled": False}, "longWaits": {"thresholdSeconds": 5, "quantile": 0.9}},
        "additionalRules": [{"alert": "SidelockCustom", "expr": "sum(sidelock_held_locks) > 1000",
                             "labels": {"severity": "info"},
                             "annotations": {"summary": "s", "description": "d"}}],
    }}})
    rules = check_prometheus_rule(one(manifests(rendered), "PrometheusRule"))
    names = [r["alert"] for r in rules]
    assert "SidelockBackendDown" not in names
    assert names[-1] == "SidelockCustom"
    waits = next(r for r in rules if r["alert"] == "SidelockLongLockWaits")
    assert waits["expr"].startswith("histogram_quantile(0.9,") and waits["expr"].endswith("> 5")
    for r in rules[:-1]:
        assert 'cluster="eu-1",job="sidelock"' in r["expr"]
        assert r["labels"]["team"] == "payments"


def test_all_alerts_disabled_still_renders_a_valid_rule(chart: helm.Chart) -> None:
    off = {"enabled": False}
    rendered = render_chart(chart, {"metrics": {"prometheusRule": {"enabled": True, "alerts": {
        "backendDown": off, "leaseLost": off, "staleLocks": off, "longWaits": off, "waitersPiling": off}}}})
    rule = one(manifests(rendered), "PrometheusRule")
    assert rule["spec"]["groups"][0]["rules"] == []


def test_example_is_off_by_default_and_renders_only_shared_resources(chart: helm.Chart) -> None:
    for values in ({}, {"example": {"enabled": False}}):
        objects = manifests(render_chart(chart, values))
        assert sorted(o["kind"] for o in objects) == ["ConfigMap", "Secret", "Service"], values


@pytest.mark.parametrize("election", [False, True], ids=["lock", "election"])
def test_example_keeps_tokens_out_of_curl_arguments(chart: helm.Chart, election: bool) -> None:
    # `ps` in the pod shows a process's arguments: the API token and the
    # lease token go to curl on stdin (--config -), written by printf, the
    # shell's own.
    values = {"example": {"enabled": True, "election": election}}
    if election:
        values["election"] = {"readinessProbe": {"enabled": True}}
    objects = manifests(render_chart(chart, values))
    deployment = next(o for o in objects if o["kind"] == "Deployment"
                      and o["metadata"]["name"] == f"{FULLNAME}-example")
    _, app = find_container(pod_spec(deployment), "app")
    script = "\n".join(line for line in app["command"][-1].split("\n")
                       if not line.lstrip().startswith("#"))
    calls = []
    for after in script.split("curl ")[1:]:
        lines = after.split("\n")
        call = [lines[0]]
        for line in lines[1:]:
            if not call[-1].rstrip().endswith("\\"):
                break
            call.append(line)
        calls.append("\n".join(call))
    assert calls, script
    for call in calls:
        assert "--config -" in call, call
        for secret in ("SIDELOCK_API_TOKEN", "$auth", "${token}"):
            assert secret not in call, f"curl {call}"


def test_notes_have_curl_commands(chart: helm.Chart) -> None:
    notes = render_chart(chart, EXAMPLE_ON)["sidelock/templates/NOTES.txt"]
    for needle in ("curl -s http://127.0.0.1:7070/healthz", "/readyz", "/metrics",
                   "Authorization: Bearer $SIDELOCK_API_TOKEN", "/v1/locks/demo", "curl -N",
                   f"kubectl get secret --namespace {NAMESPACE} {FULLNAME}",
                   f"svc/{FULLNAME}-metrics", f"deploy/{FULLNAME}-example"):
        assert needle in notes, needle


# --------------------------------------------------------------------------
# Native sidecar and Kubernetes versions
# --------------------------------------------------------------------------


def test_native_sidecar_is_refused_before_1_29(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError) as err:
        render_chart(chart, kube_version="v1.28.9")
    assert "sidecar.native=true needs Kubernetes 1.29" in str(err.value)
    assert "sidecar.native=false" in str(err.value)


def test_plain_sidecar_works_before_1_29(chart: helm.Chart) -> None:
    import kubernetes_validate.utils as kv

    objects = manifests(render_chart(chart, {"sidecar": {"native": False}}, kube_version="v1.27.3"))
    for obj in objects:
        assert kv.validate(obj, "1.27", strict=True) == "1.27"


def test_managed_cluster_version_strings(chart: helm.Chart) -> None:
    # e.g. GKE/EKS report pre-release-style versions.
    render_chart(chart, kube_version="v1.29.1-gke.1589017")
    with pytest.raises(helm.HelmRenderError):
        render_chart(chart, kube_version="v1.28.15-eks-1a2b3c")


# --------------------------------------------------------------------------
# Wrong values: rejected with a readable message
# --------------------------------------------------------------------------

SCHEMA_ERRORS = {
    "bad backend scheme": ({"backend": {"url": "http://redis:6379"}},
                           ["/backend/url", "'http://redis:6379' does not match", "redlock|zk|postgres|postgresql"]),
    "backend without scheme": ({"backend": {"url": "redis-master:6379"}}, ["/backend/url"]),
    "negative ttl (integer ms)": ({"config": {"defaultTtl": -5}}, ["/config/defaultTtl", "minimum: got -5, want 1"]),
    "negative ttl (duration)": ({"config": {"defaultTtl": "-5s"}}, ["/config/defaultTtl", "'-5s' does not match"]),
    "zero ttl": ({"config": {"maxTtl": 0}}, ["/config/maxTtl", "minimum"]),
    "unparsable duration": ({"config": {"maxWait": "forever"}}, ["/config/maxWait"]),
    "missing image repository": ({"image": {"repository": ""}}, ["/image/repository", "minLength: got 0, want 1"]),
    "image removed": ({"image": None}, ["missing property 'image'"]),
    "image repository removed": ({"image": {"repository": None}}, ["/image", "missing property 'repository'"]),
    "bad digest": ({"image": {"digest": "latest"}}, ["/image/digest"]),
    "loopback listener": ({"sidecar": {"listenHost": "127.0.0.1"}}, ["/sidecar/listenHost", "value must be one of '0.0.0.0', '::'"]),
    "native as string": ({"sidecar": {"native": "yes"}}, ["/sidecar/native", "want boolean"]),
    "port out of range": ({"sidecar": {"port": 70000}}, ["/sidecar/port", "maximum"]),
    "unknown log format": ({"config": {"logFormat": "xml"}}, ["/config/logFormat", "'json', 'text'"]),
    "typo in a key": ({"sidecar": {"nativ": True}}, ["/sidecar", "additional properties 'nativ' not allowed"]),
    "short api token": ({"auth": {"apiToken": "secret"}}, ["/auth/apiToken"]),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_ERRORS), ids=str)
def test_wrong_values_fail_the_schema(chart: helm.Chart, case: str) -> None:
    values, expected = SCHEMA_ERRORS[case]
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart(chart, values)
    message = str(err.value)
    assert "values don't meet the specifications of the schema" in message
    for needle in expected:
        assert needle in message, f"{needle!r} not in {message!r}"
    # The same check through Chart.validate_schema (it coalesces the defaults).
    with pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(values)
    assert expected[0] in str(err.value)


TEMPLATE_ERRORS = {
    "grace period shorter than shutdown grace": (
        {"sidecar": {"terminationGracePeriodSeconds": 12}},
        "sidecar.terminationGracePeriodSeconds=12 is too short: sidelock needs config.shutdownGrace (10s) plus at least 5 seconds"),
    "grace period vs longer shutdown grace": (
        {"config": {"shutdownGrace": "1m"}},
        "use 65 or more"),
    "password in backend url": (
        {"backend": {"url": "redis://:hunter2@redis:6379/0"}},
        "backend.url contains a password"),
    "password in redlock url": (
        {"backend": {"url": "redlock://:pw@a:6379,:pw@b:6379,:pw@c:6379"}},
        "backend.urlFromSecret.name"),
    "password in sentinel url": (
        {"backend": {"url": "redis+sentinel://:pw@sentinel:26379/mymaster"}},
        "backend.url contains a password"),
    "password with a slash": (
        {"backend": {"url": "redis://:ab/cd@redis:6379/0"}},
        "backend.url contains a password"),
    "password as a parameter": (
        {"backend": {"url": "postgres://db/locks?user=app&password=pw"}},
        "backend.url contains a password"),
    "default ttl above max ttl": (
        {"config": {"defaultTtl": "2h", "maxTtl": "1h"}},
        "config.defaultTtl (2h) must not be longer than config.maxTtl (1h)"),
    "default ttl above max ttl in ms": (
        {"config": {"defaultTtl": 90000, "maxTtl": "1m"}},
        "config.defaultTtl (90000ms) must not be longer than config.maxTtl (1m)"),
    "max ttl below a hold's minimum": (
        {"config": {"defaultTtl": "50ms", "maxTtl": "50ms"}},
        "config.maxTtl (50ms) must be at least 100ms"),
    "max ttl below a hold's minimum in ms": (
        {"config": {"defaultTtl": 20, "maxTtl": 99}},
        "config.maxTtl (99ms) must be at least 100ms"),
    "election example without the leader probe": (
        {"example": {"enabled": True, "election": True}},
        "example.election=true needs election.readinessProbe.enabled=true"),
    "service monitor without service": (
        {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
        "metrics.serviceMonitor.enabled needs metrics.service.enabled"),
}


@pytest.mark.parametrize("case", sorted(TEMPLATE_ERRORS), ids=str)
def test_inconsistent_values_fail_with_a_message(chart: helm.Chart, case: str) -> None:
    values, expected = TEMPLATE_ERRORS[case]
    with pytest.raises(helm.HelmRenderError) as err:
        render_chart(chart, values)
    assert expected in str(err.value)


def test_password_is_fine_when_the_url_comes_from_a_secret(chart: helm.Chart) -> None:
    objects = manifests(render_chart(chart, {"backend": {
        "url": "redis://redis:6379/0", "urlFromSecret": {"name": "redis-url", "key": "url"}}}))
    assert "backend" not in tomllib.loads(one(objects, "ConfigMap")["data"]["sidelock.toml"])


# --------------------------------------------------------------------------
# Leader election: the readiness probe that follows the leader
# --------------------------------------------------------------------------

LEADER_ON: dict[str, Any] = {
    "election": {"readinessProbe": {"enabled": True, "name": "scheduler"}},
    "example": {"enabled": True, "election": True, "replicas": 3},
}


def test_leader_probe_is_off_by_default(chart: helm.Chart) -> None:
    spec = pod_spec(one(manifests(render_chart(chart, EXAMPLE_ON)), "Deployment"))
    _, app = find_container(spec, "app")
    assert "readinessProbe" not in app


def test_a_service_routes_only_to_the_leader(chart: helm.Chart) -> None:
    objects = manifests(render_chart(chart, LEADER_ON))
    for obj in objects:
        validate_k8s(obj)
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    spec = pod_spec(deployment)
    _, app = find_container(spec, "app")
    probe = app["readinessProbe"]
    assert probe["httpGet"] == {"path": "/v1/elections/scheduler/ready", "port": 7070, "scheme": "HTTP"}
    assert probe["failureThreshold"] == 1 and probe["periodSeconds"] == 2
    script = app["command"][-1]
    assert "/v1/elections/${ELECTION}/campaign" in script and "curl -sSN" in script
    env = {e["name"]: e for e in app["env"]}
    assert env["ELECTION"]["value"] == "scheduler"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"

    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
    leader = services[f"{FULLNAME}-example-leader"]
    # Every example pod matches; readiness leaves only the leader as an endpoint.
    assert leader["spec"]["selector"].items() <= pod_metadata(deployment)["labels"].items()
    assert leader["spec"]["selector"]["app.kubernetes.io/component"] == "example"
    (port,) = leader["spec"]["ports"]
    assert port["targetPort"] == 7070


def test_notes_show_the_leader_endpoint(chart: helm.Chart) -> None:
    notes = render_chart(chart, LEADER_ON)["sidelock/templates/NOTES.txt"]
    assert f"kubectl get endpoints --namespace {NAMESPACE} {FULLNAME}-example-leader" in notes


def test_the_leader_probe_follows_the_sidecar_port(chart: helm.Chart) -> None:
    values = deep_merge(LEADER_ON, {"sidecar": {"port": 8181}, "election": {"readinessProbe": {
        "periodSeconds": 5, "failureThreshold": 2}}})
    spec = pod_spec(one(manifests(render_chart(chart, values)), "Deployment"))
    _, app = find_container(spec, "app")
    assert app["readinessProbe"]["httpGet"]["port"] == 8181
    assert app["readinessProbe"]["periodSeconds"] == 5
    assert app["readinessProbe"]["failureThreshold"] == 2


@pytest.mark.parametrize("name", ["", "a/b", "x" * 201, "with space"])
def test_bad_election_names_fail_the_schema(chart: helm.Chart, name: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart(chart, {"election": {"readinessProbe": {"enabled": True, "name": name}}})
    assert "election" in str(err.value)


# --------------------------------------------------------------------------
# The named templates inside an application chart
# --------------------------------------------------------------------------


def test_app_chart_dependency_resolves(app_chart_dir: Path) -> None:
    deps = helm.dependency_list(app_chart_dir)
    assert deps == [{"name": "sidelock", "version": ">=0.1.0-0",
                     "repository": "file://../../../helm/sidelock", "status": "ok"}]


def test_app_chart_routes_to_the_leader_with_one_value(app_chart: helm.Chart) -> None:
    off = manifests(render_chart(app_chart, {}, name="shop"))
    _, app = find_container(pod_spec(by_kind(off, "Deployment")[0]), "app")
    assert "readinessProbe" not in app
    on = manifests(render_chart(app_chart, {"sidelock": {"election": {"readinessProbe": {
        "enabled": True, "name": "orders-consumer"}}}}, name="shop"))
    deployment = by_kind(on, "Deployment")[0]
    validate_k8s(deployment)
    _, app = find_container(pod_spec(deployment), "app")
    assert app["readinessProbe"]["httpGet"]["path"] == "/v1/elections/orders-consumer/ready"


def test_app_chart_lints_strict(app_chart_dir: Path) -> None:
    report = helm.lint(app_chart_dir, strict=True, with_subcharts=True, kube_version="v1.29.0")
    assert report["total_charts_linted"] >= 1
    assert _lint_problems(report) == []
    # The subchart's schema applies to the application's sidelock values.
    bad = helm.lint(app_chart_dir, {"sidelock": {"config": {"maxTtl": "-1h"}}}, strict=True)
    assert any("/config/maxTtl" in e for e in bad["errors"]), bad


@pytest.mark.parametrize("native", [True, False], ids=["native", "plain"])
def test_app_chart_injects_the_sidecar(app_chart: helm.Chart, chart_values: dict[str, Any], native: bool) -> None:
    overrides = {"sidelock": {"sidecar": {"native": native}}}
    rendered = render_chart(app_chart, overrides, name="shop")
    objects = manifests(rendered)
    for obj in objects:
        if obj["kind"] not in CRD_KINDS:
            validate_k8s(obj)

    app_values = deep_merge(app_chart.values, overrides)["sidelock"]
    values = deep_merge(chart_values, app_values)
    cm = one(objects, "ConfigMap")
    secret = one(objects, "Secret")
    svc = one(objects, "Service")
    assert cm["metadata"]["name"] == secret["metadata"]["name"] == "shop-sidelock"
    assert by_kind(objects, "Deployment") and all(
        d["metadata"]["name"] == "shop-app" for d in by_kind(objects, "Deployment")
    ), "the sidelock example must be off in the application chart"
    check_config(cm, values)

    workloads = by_kind(objects, "Deployment") + by_kind(objects, "CronJob")
    assert len(workloads) == (2 if native else 1)  # the CronJob needs a native sidecar
    for workload in workloads:
        spec = pod_spec(workload)
        c = check_sidecar(spec, values, secret="shop-sidelock", configmap="shop-sidelock")
        # The sidecar image is sidelock's, not the application's appVersion.
        assert c["image"] == f"{values['image']['repository']}:{values['image']['tag']}"
        assert svc["spec"]["selector"].items() <= pod_metadata(workload)["labels"].items()
        app_container = next(x for x in spec["containers"] if x["name"] != "sidelock")
        env = {e["name"]: e for e in app_container["env"]}
        assert env["SIDELOCK_URL"]["value"] == "http://127.0.0.1:7070"
        assert env["SIDELOCK_API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "shop-sidelock"

    # Parent and subchart see the same values: same config checksum.
    deployment = one(objects, "Deployment")
    digest = pod_metadata(deployment)["annotations"]["checksum/sidelock-config"]
    assert digest == hashlib.sha256(cm["data"]["sidelock.toml"].rstrip("\n").encode()).hexdigest()


def test_app_chart_values_flow_into_the_sidecar(app_chart: helm.Chart) -> None:
    objects = manifests(render_chart(app_chart, {"sidelock": {
        "fullnameOverride": "locks", "sidecar": {"containerName": "locker", "port": 7300},
        "auth": {"existingSecret": "shop-lock-tokens"},
        "config": {"shutdownGrace": "30s"}, "metrics": {"serviceMonitor": {"enabled": True}},
    }}, name="shop"))
    deployment = one(objects, "Deployment")
    spec = pod_spec(deployment)
    field, c = find_container(spec, "locker")
    assert field == "initContainers"
    assert c["ports"][0]["containerPort"] == 7300
    assert {e["name"]: e for e in c["env"]}["SIDELOCK_API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "shop-lock-tokens"
    assert by_kind(objects, "Secret") == []
    assert one(objects, "ConfigMap")["metadata"]["name"] == "locks"
    assert spec["volumes"][-1]["configMap"]["name"] == "locks"
    assert pod_metadata(deployment)["labels"]["sidelock/instance"] == "locks"
    assert spec["terminationGracePeriodSeconds"] == 45
    app_env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert app_env["SIDELOCK_URL"]["value"] == "http://127.0.0.1:7300"
    check_service_monitor(one(objects, "ServiceMonitor"), one(objects, "Service"))


def test_app_chart_is_checked_by_the_sidelock_schema(app_chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart(app_chart, {"sidelock": {"backend": {"url": "mysql://db/locks"}}}, name="shop")
    assert "/sidelock/backend/url" in str(err.value) or "/backend/url" in str(err.value)


# --------------------------------------------------------------------------
# Container image definition
# --------------------------------------------------------------------------


def test_dockerfile_matches_chart_defaults(chart_values: dict[str, Any]) -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    instructions = [line.strip() for line in dockerfile.splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    froms = [i for i in instructions if i.startswith("FROM ")]
    assert len(froms) >= 2, "multi-stage build"
    assert " AS build" in froms[0]
    runtime = froms[-1].split()[1]
    assert runtime.startswith("gcr.io/distroless/") and runtime.endswith(":nonroot"), runtime

    final_stage = instructions[instructions.index(froms[-1]):]
    sec = chart_values["sidecar"]["securityContext"]
    assert f"USER {sec['runAsUser']}:{sec['runAsGroup']}" in final_stage
    assert f"EXPOSE {chart_values['sidecar']['port']}" in final_stage
    assert 'ENTRYPOINT ["/usr/local/bin/sidelock"]' in final_stage
    assert 'CMD ["serve"]' in final_stage
    assert any("cargo build --release --locked --bin sidelock" in i for i in instructions)
    assert any(i.startswith("COPY --from=build ") for i in final_stage)

    ignored = (REPO / ".dockerignore").read_text().split()
    for pattern in ("target/", ".git", ".venv/", "helm/", "tests/helm/"):
        assert pattern in ignored, pattern


# --------------------------------------------------------------------------
# The Unix socket shared through an emptyDir
# --------------------------------------------------------------------------

SOCKET_ON = {"socket": {"enabled": True}, "example": {"enabled": True}}


def test_socket_is_off_by_default(chart: helm.Chart) -> None:
    objects = manifests(render_chart(chart, {"example": {"enabled": True}}))
    spec = pod_spec(one(objects, "Deployment"))
    assert all("emptyDir" not in v for v in spec["volumes"])
    _, app = find_container(spec, "app")
    assert "volumeMounts" not in app
    assert "SIDELOCK_SOCKET" not in {e["name"] for e in app["env"]}
    config = tomllib.loads(one(objects, "ConfigMap")["data"]["sidelock.toml"])
    assert isinstance(config["listen"], str)


def test_the_socket_is_shared_with_the_application_through_an_empty_dir(chart: helm.Chart) -> None:
    objects = manifests(render_chart(chart, SOCKET_ON))
    for obj in objects:
        validate_k8s(obj)
    config = tomllib.loads(one(objects, "ConfigMap")["data"]["sidelock.toml"])
    assert config["listen"] == ["0.0.0.0:7070", "unix:/run/sidelock/sidelock.sock"]
    spec = pod_spec(one(objects, "Deployment"))
    (volume,) = [v for v in spec["volumes"] if "emptyDir" in v]
    containers = spec.get("initContainers", []) + spec["containers"]
    sidecar = next(c for c in containers if c["name"] == "sidelock")
    _, app = find_container(spec, "app")
    for container in (sidecar, app):
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts[volume["name"]]["mountPath"] == "/run/sidelock", container["name"]
    env = {e["name"]: e for e in app["env"]}
    assert env["SIDELOCK_SOCKET"]["value"] == "/run/sidelock/sidelock.sock"


def test_app_chart_mounts_the_socket_with_one_value(app_chart: helm.Chart) -> None:
    objects = manifests(render_chart(app_chart, {"sidelock": {"socket": {"enabled": True, "dir": "/sock"}}}))
    spec = pod_spec(one(objects, "Deployment"))
    _, app = find_container(spec, "app")
    (mount,) = app["volumeMounts"]
    assert mount["mountPath"] == "/sock"
    assert {e["name"]: e for e in app["env"]}["SIDELOCK_SOCKET"]["value"] == "/sock/sidelock.sock"


@pytest.mark.parametrize("socket", [{"dir": "relative"}, {"dir": "/run/"}, {"name": "a/b"}, {"name": ""}])
def test_bad_socket_paths_fail_the_schema(chart: helm.Chart, socket: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart(chart, {"socket": {"enabled": True, **socket}})
    assert "socket" in str(err.value)
