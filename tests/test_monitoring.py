"""The monitoring kit in `monitoring/` (Prometheus alert rules, a Grafana dashboard)
names only metrics a running instance serves, and the rules are valid and fire when
they should (promtool's own checks and unit tests, where promtool is installed:
Debian's `prometheus` package, which `.ci/run` installs)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import aiohttp
import pytest
import yaml

import pace
from plait.instance import Instance
from plait.ports import free_port

MONITORING = Path(__file__).resolve().parent.parent / "monitoring"
RULES = MONITORING / "prometheus-rules.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
_NAME = re.compile(r"\bplait_[a-z_]+\b")


def _rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    for rule in rules:
        assert {"alert", "expr", "labels", "annotations"} <= set(rule), rule
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule
    return [rule["expr"] for rule in rules]


def _dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    expressions += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return expressions


def _served(text: str) -> set[str]:
    """Every series name /metrics can show (a labelled counter nobody used yet has its
    TYPE line and no sample)."""
    names: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        names.add(name)
        if kind == "counter":
            names.add(name if name.endswith("_total") else f"{name}_total")
    return names


async def test_the_rules_and_the_dashboard_name_only_metrics_an_instance_serves(
    dsn: str,
) -> None:
    config = {
        "instance_name": "w",
        "database": dsn,
        "streams": [{"name": "typing", "kind": "memory", "writers": ["w"]}],
        "replication": {"transport": "tcp", "tcp": {"hub": "w", "port": free_port()}},
    }
    async with Instance(config) as instance, aiohttp.ClientSession() as http:
        response = await http.get(f"{instance.http_url}/metrics")
        assert response.status == 200
        served = _served(await response.text())
    expressions = _rule_expressions() + _dashboard_expressions()
    named = {name for expr in expressions for name in _NAME.findall(expr)}
    assert len(named) >= 15, sorted(named)
    assert named <= served, f"named but not served: {sorted(named - served)}"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_finds_the_rules_valid_and_their_unit_tests_pass() -> None:
    for args in (["check", "rules", RULES.name], ["test", "rules", "prometheus-rules.test.yml"]):
        done = pace.run(["promtool", *args], 60, cwd=MONITORING, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
