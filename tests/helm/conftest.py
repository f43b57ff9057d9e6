"""Shared helpers for the Helm chart tests.

Everything here is offline and real:

* Helm: ``helm-python-sdk`` binds to ``libhelm_c``, Helm v4's own Go library.
  ``helm_python.lint`` is ``helm lint``. Rendering goes through the library's
  ``helm_render`` entry point (what ``Chart.render`` calls); we call it
  directly because its options also take ``kube_version`` and
  ``api_versions`` (``helm template --kube-version/--api-versions``) and
  ``strict``, which the Python wrapper does not expose yet. Values are
  validated against ``values.schema.json`` by Helm itself while rendering.
* Kubernetes schemas: ``kubernetes-validate`` ships the OpenAPI-derived JSON
  schemas of every supported Kubernetes minor version inside the package
  (``kubernetes_validate/kubernetes-json-schema/v1.29.0-local-strict``), so
  validation never touches the network. ``strict`` rejects unknown fields.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate.utils as kv
import pytest
import yaml
from helm_python import _native

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "sidelock"
APP_CHART_DIR = REPO / "tests" / "helm" / "app-chart"

KUBE_VERSION = "1.29"
RELEASE = "demo"
NAMESPACE = "apps"

# CRDs of the Prometheus Operator: kubernetes-validate has no schema for them.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def render_chart(
    chart: helm.Chart,
    values: dict[str, Any] | None = None,
    *,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
    kube_version: str = f"v{KUBE_VERSION}.0",
    api_versions: list[str] | None = None,
) -> dict[str, str]:
    """``helm template`` with Helm's library: returns {template path: text}.

    Raises HelmValuesError (schema) or HelmRenderError (template ``fail``).
    """
    opts: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "kube_version": kube_version,
        "is_install": True,
        "strict": True,
    }
    if api_versions:
        opts["api_versions"] = api_versions
    rendered = _native.call_string(
        "helm_render",
        chart._raw(),
        json.dumps(values or {}),
        json.dumps(opts),
    )
    return json.loads(rendered)


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """All Kubernetes objects of a rendering (NOTES.txt excluded)."""
    objects = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def validate_k8s(obj: dict[str, Any]) -> None:
    """Validate one object against the Kubernetes 1.29 schema (strict)."""
    try:
        version = kv.validate(obj, KUBE_VERSION, strict=True)
    except kv.ValidationError as err:
        pytest.fail(
            f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes "
            f"{err.version}: {err.message} at {list(err.absolute_path)}"
        )
    except kv.SchemaNotFoundError as err:
        pytest.fail(err.message)
    assert version == KUBE_VERSION


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec = workload["spec"]
    if workload["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec["template"]["spec"]


def pod_metadata(workload: dict[str, Any]) -> dict[str, Any]:
    spec = workload["spec"]
    if workload["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec["template"]["metadata"]


def find_container(spec: dict[str, Any], name: str) -> tuple[str, dict[str, Any]]:
    """(list name, container) of the container called ``name`` in a pod spec."""
    hits = [
        (field, c)
        for field in ("initContainers", "containers")
        for c in spec.get(field) or []
        if c["name"] == name
    ]
    assert len(hits) == 1, f"container {name!r} found {len(hits)} times"
    return hits[0]


@pytest.fixture(scope="session")
def chart() -> helm.Chart:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def chart_values(chart: helm.Chart) -> dict[str, Any]:
    return chart.values


@pytest.fixture(scope="session")
def app_chart_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test application chart with its dependency resolved.

    Copied into a temporary tree that keeps the relative layout, so that the
    dependency's ``file://../../../helm/sidelock`` resolves to the chart under
    test and ``helm dependency update`` writes charts/ and Chart.lock outside
    the repository.
    """
    root = tmp_path_factory.mktemp("app")
    shutil.copytree(CHART_DIR, root / "helm" / "sidelock")
    app = root / "tests" / "helm" / "app-chart"
    shutil.copytree(APP_CHART_DIR, app, ignore=shutil.ignore_patterns("charts", "Chart.lock"))
    helm.dependency_update(app)
    return app


@pytest.fixture(scope="session")
def app_chart(app_chart_dir: Path) -> helm.Chart:
    with helm.Chart.load(app_chart_dir) as loaded:
        yield loaded
