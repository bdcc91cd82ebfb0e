"""The metrics module without a cluster: label enums, exposition, textfile,
config keys, and the example dashboard and alert rules under examples/monitoring."""

from __future__ import annotations

import ast
import json
import os
import platform
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from reconciler import __version__
from reconciler.daemon.metrics import (
    REFUSAL_OTHER,
    REFUSAL_REASONS,
    Metrics,
    ceph_reachable,
    is_loopback,
    parse_listen,
    refusal_reason,
    step_kind,
)
from reconciler.plan.steps import Step
from reconciler.spec.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
MONITORING = ROOT / "examples" / "monitoring"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
            "gauge": ("",), "summary": ("", "_count", "_sum")}


def exported_names() -> set[str]:
    """Every sample name a daemon's registry can expose (labelled children or not)."""
    names = set()
    for fam in Metrics().registry.collect():
        names.update(fam.name + s for s in SUFFIXES[fam.type])
    return names


def referenced(expr: str) -> set[str]:
    return set(re.findall(r"\brbd_reconciler_[a-z_]+\b", expr))


def test_registries_are_private() -> None:
    a, b = Metrics(), Metrics()
    a.set_phase("v1", "Published")
    a.backoffs.inc()
    text_b = generate_latest(b.registry).decode()
    assert "v1" not in text_b and "rbd_reconciler_backoffs_total 0.0" in text_b
    assert 'rbd_reconciler_volume_phase{phase="Published",volume="v1"} 1.0' in \
        generate_latest(a.registry).decode()


def test_volume_states_and_retain() -> None:
    m = Metrics()
    m.set_phase("a", "Published")
    m.set_phase("b", "Frozen")
    m.set_phase("c", "something new")  # never free text as a label value
    m.retain({"a", "c"})
    fams = {f.name: f for f in text_string_to_metric_families(
        generate_latest(m.registry).decode())}
    phases = {s.labels["volume"]: s.labels["phase"]
              for s in fams["rbd_reconciler_volume_phase"].samples}
    assert phases == {"a": "Published", "c": "Other"}
    counts = {s.labels["phase"]: s.value for s in fams["rbd_reconciler_volumes"].samples}
    assert counts["Published"] == 1 and counts["Frozen"] == 0
    assert not fams["rbd_reconciler_ceph_up"].samples  # never asked: no guess


@pytest.mark.parametrize(("message", "reason"), [
    ("shrinking p/img from 1 GiB to 512 MiB is refused: it would cut off data", "shrink"),
    ("image p/img is open by 1 other client(s) (c.1)", "in_use"),
    ("refusing to delete p/img: it was not created by this node (owner: x)", "not_owned"),
    ("p/img is owned by other-node", "not_owned"),
    ("/dev/loop3 carries LUKS, not ext4; refusing to format over it", "foreign_filesystem"),
    ("staging path /srv/s is not a mount of /dev/loop3; refusing to publish it",
     "staging_not_mounted"),
    ("/srv/x: /srv is a symlink; paths are used exactly as written", "symlink"),
    ("a sentence nobody wrote yet", REFUSAL_OTHER),
    (None, REFUSAL_OTHER),
])
def test_refusal_reasons(message: str | None, reason: str) -> None:
    assert refusal_reason(message) == reason


def _render(node: ast.expr) -> str | None:
    """A refusal message's literal text with each {placeholder} as X."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else "X" for v in node.values)
    if isinstance(node, ast.BinOp):
        left, right = _render(node.left), _render(node.right)
        return None if left is None else left + (right or "X")
    if isinstance(node, ast.IfExp):
        return _render(node.body)
    return None


def test_every_refusal_in_the_code_has_a_reason() -> None:
    """A new refusal message needs a pattern in metrics.REFUSAL_REASONS:
    otherwise it is counted as "other" and dashboards cannot tell it apart."""
    unclassified = []
    for path in sorted([*(ROOT / "reconciler" / "plan").glob("*.py"),
                        *(ROOT / "reconciler" / "apply").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(
                f, ast.Attribute) else ""
            withheld = (name == "append" and isinstance(f, ast.Attribute)
                        and isinstance(f.value, ast.Attribute) and f.value.attr == "withheld")
            if name in ("Refused", "StepRefused") or withheld:
                text = _render(node.args[0])
                if text is not None and refusal_reason(text) == REFUSAL_OTHER:
                    unclassified.append(f"{path.name}:{node.lineno}: {text}")
    assert not unclassified, "\n".join(unclassified)


def test_step_kinds_are_label_values() -> None:
    actions = {c.action for c in Step.__subclasses__()}
    assert "create image" in actions
    kinds = {step_kind(a) for a in actions}
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", k) for k in kinds), kinds
    assert "set_image_meta" in kinds


def test_ceph_reachable() -> None:
    assert ceph_reachable({"rbd"}, {}) is True
    assert ceph_reachable(set(), {}) is None
    assert ceph_reachable(set(), {"rbd": "cannot reach Ceph: no answer within 5 s"}) is False
    assert ceph_reachable(set(), {"dead": "no answer within 5 s"}) is True  # a dead pool


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("9464") == ("127.0.0.1", 9464)
    assert parse_listen(":9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    assert parse_listen("0.0.0.0:9464") == ("0.0.0.0", 9464)  # allowed: an explicit choice
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("node.example")
    for bad in ("", "host:", "1:99999", "a b:1"):
        with pytest.raises(ValueError):
            parse_listen(bad)


def test_textfile_is_replaced_atomically(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    m = Metrics()
    prom = tmp_path / "rbd.prom"
    prom.write_text("old")
    m.frozen_files.set(2)
    m.write_textfile(prom)
    assert "rbd_reconciler_frozen_files 2.0" in prom.read_text()
    assert oct(prom.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in tmp_path.iterdir()] == ["rbd.prom"]
    m.write_textfile(tmp_path / "missing" / "rbd.prom")  # logged, never raised
    assert "cannot write" in caplog.text


def _config(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(textwrap.dedent(body))
    return p


def test_config_keys(tmp_path: Path) -> None:
    c = load_config(_config(tmp_path, """\
        metrics:
          listen: "127.0.0.1:9464"
          textfile: /var/lib/node_exporter/textfile/rbd_reconciler.prom
        """))
    assert c.metrics.listen == "127.0.0.1:9464"
    assert c.metrics.textfile == Path("/var/lib/node_exporter/textfile/rbd_reconciler.prom")
    off = load_config(_config(tmp_path, "metrics: {}\n"))
    assert off.metrics.listen is None and off.metrics.textfile is None
    for bad, field in (('listen: "127.0.0.1:70000"', "metrics.listen"),
                       ('listen: "http://x:1"', "metrics.listen"),
                       ("textfile: /tmp/rbd.txt", "metrics.textfile"),
                       ("textfile: rel.prom", "metrics.textfile"),
                       ("labels: {a: b}", "metrics")):
        with pytest.raises(ConfigError) as err:
            load_config(_config(tmp_path, f"metrics:\n  {bad}\n"))
        assert field in str(err.value), (bad, str(err.value))


def test_example_node_config_loads() -> None:
    c = load_config(ROOT / "examples" / "config" / "node.yaml")
    assert c.metrics.listen is not None and parse_listen(c.metrics.listen)[0] == "127.0.0.1"


def test_dashboard_references_only_exported_metrics() -> None:
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    names = exported_names()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    assert len(dash["panels"]) >= 8
    for expr in exprs:
        refs = referenced(expr)
        assert refs, expr
        assert refs <= names, (expr, refs - names)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_alert_rules_parse_and_reference_exported_metrics() -> None:
    doc = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    names = exported_names()
    rules = {r["alert"]: r for g in doc["groups"] for r in g["rules"]}
    for rule in rules.values():
        assert {"alert", "expr", "for"} <= set(rule), rule
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
        refs = referenced(rule["expr"])
        assert refs <= names, (rule["alert"], refs - names)
        assert refs or rule["alert"] == "RbdReconcilerDown", rule
    # A daemon that stopped reporting: every other alert goes quiet with it.
    down = rules["RbdReconcilerDown"]["expr"]
    assert 'up{job="rbd-reconciler"} == 0' in down and 'absent(up{job="rbd-reconciler"})' in down
    assert 'phase="Failed"' in rules["RbdVolumeFailed"]["expr"]
    assert rules["RbdVolumeFailed"]["for"] == rules["RbdVolumeFrozen"]["for"] == "10m"
    assert rules["RbdCephUnreachable"]["for"] == "5m"
    assert "3 * rbd_reconciler_resync_interval_seconds" in \
        rules["RbdReconcilerNoSuccessfulPass"]["expr"]


def github_anchors(markdown: str) -> set[str]:
    """The anchors a git forge gives headings (GitHub's rule: lower case,
    punctuation but - and _ dropped, spaces to -); MkDocs gives the same to
    these, and its strict build (scripts/build-docs.sh) checks its own."""
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_every_alert_has_a_runbook_in_the_docs() -> None:
    """Each runbook_url names its alert's entry in docs/troubleshooting.md."""
    doc = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    page = ROOT / "docs" / "troubleshooting.md"
    text = page.read_text()
    anchors = github_anchors(text)
    assert text.startswith("# Troubleshooting\n")
    for rule in (r for g in doc["groups"] for r in g["rules"]):
        url = rule.get("annotations", {}).get("runbook_url", "")
        assert re.fullmatch(r"https://\S+/docs/troubleshooting\.md#[a-z0-9-]+", url), \
            (rule["alert"], url)
        anchor = url.rsplit("#", 1)[1]
        assert anchor == rule["alert"].lower() and anchor in anchors, (rule["alert"], anchor)
        assert f"\n## {rule['alert']}\n" in text, rule["alert"]  # an entry of its own


def test_known_label_values_exist_at_zero_from_the_start() -> None:
    """Before any event: what an alert or a dashboard panel selects on."""
    m = Metrics()
    s = {(x.name, frozenset(x.labels.items())): x.value
         for fam in text_string_to_metric_families(generate_latest(m.registry).decode())
         for x in fam.samples}
    for result in ("ok", "refused", "error"):
        assert s[("rbd_reconciler_passes_total", frozenset({("result", result)}))] == 0
    for reason in [r for r, _ in REFUSAL_REASONS] + [REFUSAL_OTHER]:
        assert s[("rbd_reconciler_refusals_total", frozenset({("reason", reason)}))] == 0
    kinds = {step_kind(c.action) for c in Step.__subclasses__()}
    for kind in kinds | {"crash"}:
        assert s[("rbd_reconciler_failures_total", frozenset({("reason", kind)}))] == 0
    for kind in kinds:
        assert s[("rbd_reconciler_step_duration_seconds_count",
                  frozenset({("action", kind)}))] == 0
    [(labels, v)] = [(dict(k[1]), v) for k, v in s.items()
                     if k[0] == "rbd_reconciler_build_info"]
    assert v == 1 and labels["version"] == __version__
    assert labels["python"] == platform.python_version()
    m.csi_served(["NodeStageVolume"])
    assert 'rbd_reconciler_csi_calls_total{code="OK",method="NodeStageVolume"} 0.0' in \
        generate_latest(m.registry).decode()


PROMTOOL = os.environ.get("PROMTOOL") or shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: prometheus; "
                                             "or PROMTOOL=/path/to/promtool)")
def test_promtool_checks_and_tests_the_rules() -> None:
    """Prometheus' own parser, and the Down alert evaluated: scrapes failing,
    the target gone (absent), a healthy one (examples/monitoring/alerts_test.yaml)."""
    assert PROMTOOL is not None
    for args in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts_test.yaml"]):
        proc = subprocess.run([PROMTOOL, *args], cwd=MONITORING, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_stalled_volume_exports_since_when_and_loses_it_once_it_moves() -> None:
    m = Metrics()
    m.set_phase("s", "Stalled", stalled_since=1_800_000_000.0)
    m.set_phase("f", "Fenced")
    fams = {f.name: f for f in text_string_to_metric_families(
        generate_latest(m.registry).decode())}
    [since] = fams["rbd_reconciler_volume_io_stalled_since_timestamp_seconds"].samples
    assert since.labels == {"volume": "s"} and since.value == 1_800_000_000.0
    counts = {s.labels["phase"]: s.value for s in fams["rbd_reconciler_volumes"].samples}
    assert counts["Stalled"] == 1 and counts["Fenced"] == 1
    m.set_phase("s", "Published")
    fams = {f.name: f for f in text_string_to_metric_families(
        generate_latest(m.registry).decode())}
    assert not fams["rbd_reconciler_volume_io_stalled_since_timestamp_seconds"].samples


def test_every_source_failure_reason_has_a_series_from_the_start() -> None:
    """A reason the source code can give (a literal in reconciler/source/ or
    the follower) is among those zeroed at start: an alert on it fires on
    its first occurrence."""
    import reconciler.daemon.metrics as metrics_module

    code = "".join(p.read_text() for p in (ROOT / "reconciler" / "source").glob("*.py"))
    code += (ROOT / "reconciler" / "daemon" / "follow.py").read_text()
    found = set(re.findall(r'Refused\("([A-Za-z]+)"', code))
    found |= set(re.findall(r'"(?:failed|refused)", "([A-Za-z]+)"', code))
    found |= {f"NotA{k}" for k in ("Commit", "Tag")}  # built as "NotA" + kind
    found -= {"NotA", "NoPrevious", "UnknownRevision"}  # the CLI's alone (rollback, verify)
    assert found <= set(metrics_module.SOURCE_FAILURE_REASONS), \
        found - set(metrics_module.SOURCE_FAILURE_REASONS)


def test_no_created_series_with_debian_12s_prometheus_client(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian 12's python3-prometheus-client (0.16) has no
    disable_created_metrics(); the daemon died at start there (node tests,
    scripts/node-tests.sh). Without the function, the same switch is set."""
    import prometheus_client
    import prometheus_client.metrics

    monkeypatch.delattr(prometheus_client, "disable_created_metrics", raising=False)
    monkeypatch.setattr(prometheus_client.metrics, "_use_created", True)
    m = Metrics()
    assert prometheus_client.metrics._use_created is False
    assert "_created" not in generate_latest(m.registry).decode()
