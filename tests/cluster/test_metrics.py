"""Prometheus metrics of a running daemon: scraped over HTTP and read from the
textfile, checked against the state they describe."""

from __future__ import annotations

import json
import platform
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml
from conftest import NodeUnderTest
from prometheus_client.parser import text_string_to_metric_families
from test_daemon import Daemon, set_observe_timeout, set_resync, spec, start, wait_for
from test_metrics_units import MONITORING, referenced

from reconciler import __version__
from reconciler.csi import csi_pb2 as pb

pytestmark = pytest.mark.ceph
__all__ = ["start"]  # the daemon fixture, shared with test_daemon
T = 30.0

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> Samples | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return parse(r.read().decode())
    except OSError:  # not listening yet
        return None


def metrics_config(node: NodeUnderTest, port: int, textfile: Path | None = None) -> None:
    extra = f"metrics:\n  listen: \"127.0.0.1:{port}\"\n"
    if textfile is not None:
        extra += f"  textfile: {textfile}\n"
    node.config.write_text(node.config.read_text() + extra)


def wait_metric(get: Callable[[], Samples | None], what: str,
                cond: Callable[[Samples], bool]) -> Samples:
    def ok() -> Samples | None:
        s = get()
        return s if s is not None and cond(s) else None
    return wait_for(ok, what)  # type: ignore[return-value]


def test_http_and_textfile_follow_the_state(node: NodeUnderTest,
                                            start: Callable[..., Daemon]) -> None:
    set_resync(node, 0.5)
    port = free_port()
    prom_dir = node.root / "textfile"
    prom_dir.mkdir()
    prom = prom_dir / "rbd_reconciler.prom"
    metrics_config(node, port, prom)
    name = node.name("met")
    f = node.write(name, spec(node))
    good = f.read_text()
    d = start()
    d.wait_phase(name, "Published")

    def textfile() -> Samples | None:
        return parse(prom.read_text()) if prom.exists() else None

    def published(s: Samples) -> bool:
        return all(value(s, f"rbd_reconciler_volume_{m}", volume=name, phase="Published") == 1
                   for m in ("phase", "observed_phase"))

    for get in (lambda: scrape(port), textfile):
        s = wait_metric(get, "Published in the metrics", published)
        assert value(s, "rbd_reconciler_volume_wanted_phase", volume=name,
                     phase="Published") == 1
        assert value(s, "rbd_reconciler_volumes", phase="Published") == 1
        assert value(s, "rbd_reconciler_volumes", phase="Failed") == 0
        assert value(s, "rbd_reconciler_ceph_up") == 1
        assert value(s, "rbd_reconciler_frozen_files") == 0
        assert value(s, "rbd_reconciler_unknown_volumes") == 0
        assert value(s, "rbd_reconciler_volumes_in_backoff") == 0
        last = value(s, "rbd_reconciler_last_successful_pass_timestamp_seconds")
        assert last is not None and abs(time.time() - last) < 60
        assert (value(s, "rbd_reconciler_passes_total", result="ok") or 0) >= 1
        assert (value(s, "rbd_reconciler_pass_duration_seconds_count") or 0) >= 1
        for action in ("create_image", "map", "format", "stage", "publish"):
            assert value(s, "rbd_reconciler_step_duration_seconds_count", action=action) == 1, \
                action
        # Only volume names and enums as label values: no paths, no messages.
        labels = {v for key in s for _, v in key[1]}
        assert not [v for v in labels if "/" in v or " " in v], labels
    # The rename is atomic: no temp file is left beside the .prom.
    assert [p.name for p in prom_dir.iterdir()] == [prom.name]

    # A file that fails to load: its volume is Frozen, one frozen file.
    f.write_text(good.replace("size: 64Mi", "size: 64 megs"))
    d.wait_phase(name, "Frozen")

    def frozen(s: Samples) -> bool:
        return (value(s, "rbd_reconciler_frozen_files") == 1
                and value(s, "rbd_reconciler_volume_phase", volume=name, phase="Frozen") == 1)

    wait_metric(lambda: scrape(port), "frozen in the metrics", frozen)
    wait_metric(textfile, "frozen in the textfile", frozen)

    # A shrink is refused: a refusal with its reason, a backoff, a Failed volume.
    f.write_text(good.replace("64Mi", "32Mi"))
    d.wait_phase(name, "Failed")
    s = wait_metric(lambda: scrape(port), "the refusal counted",
                    lambda s: value(s, "rbd_reconciler_volume_phase", volume=name,
                                    phase="Failed") == 1)
    assert (value(s, "rbd_reconciler_refusals_total", reason="shrink") or 0) >= 1
    assert (value(s, "rbd_reconciler_backoffs_total") or 0) >= 1
    assert value(s, "rbd_reconciler_volumes_in_backoff") == 1
    assert value(s, "rbd_reconciler_frozen_files") == 0
    assert not [k for k, v in s.items()  # refused, not failed
                if k[0] == "rbd_reconciler_failures_total" and v != 0]

    f.write_text(good)  # a new spec is tried at once, backoff or not
    d.wait_phase(name, "Published")
    wait_metric(lambda: scrape(port), "back to Published",
                lambda s: published(s) and value(s, "rbd_reconciler_volumes_in_backoff") == 0)
    assert d.stop() == 0


def used_by_alerts_and_dashboard() -> set[str]:
    doc = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    exprs = [r["expr"] for g in doc["groups"] for r in g["rules"]]
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return {name for e in exprs for name in referenced(e)}


# Per-volume series appear with their volume; ceph_up says nothing until a
# pass needed Ceph (a guess either way would be an alert or a lie).
NOT_BEFORE_EVENTS = {"rbd_reconciler_volume_phase", "rbd_reconciler_volume_observed_phase",
                     "rbd_reconciler_volume_wanted_phase", "rbd_reconciler_volume_condition",
                     "rbd_reconciler_ceph_up",
                     "rbd_reconciler_volume_io_stalled_since_timestamp_seconds"}
# CSI's, once CSI serves (test_csi_calls_counted_by_method_and_code).
CSI = {"rbd_reconciler_csi_calls_total", "rbd_reconciler_csi_call_duration_seconds_bucket"}


def test_every_series_alerts_use_exists_from_start_up(node: NodeUnderTest,
                                                      start: Callable[..., Daemon]) -> None:
    """No volume, no event: the first scrape that answers already has every
    series an alert or a dashboard panel reads (at 0), and build_info."""
    port = free_port()
    metrics_config(node, port)
    d = start()

    def first() -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return None
    text = wait_for(first, "the metrics endpoint")
    assert isinstance(text, str)
    s = parse(text)
    have = {name for name, _ in s}
    used = used_by_alerts_and_dashboard()
    assert "rbd_reconciler_refusals_total" in used and "rbd_reconciler_passes_total" in used
    missing = {n for n in used - NOT_BEFORE_EVENTS - CSI if n not in have}
    assert not missing, missing
    for name in used & NOT_BEFORE_EVENTS:  # declared, at least
        assert f"# TYPE {name.removesuffix('_total')} " in text, name
    for result in ("refused", "error"):
        assert value(s, "rbd_reconciler_passes_total", result=result) == 0
    assert value(s, "rbd_reconciler_refusals_total", reason="shrink") == 0
    assert value(s, "rbd_reconciler_failures_total", reason="crash") == 0
    assert value(s, "rbd_reconciler_step_duration_seconds_count", action="stage") == 0
    assert value(s, "rbd_reconciler_build_info", version=__version__,
                 python=platform.python_version()) == 1
    assert d.stop() == 0


def test_ceph_unreachable(node: NodeUnderTest, start: Callable[..., Daemon]) -> None:
    """A cluster that does not answer: ceph_up 0 and the volume unknown."""
    set_resync(node, 0.5)
    set_observe_timeout(node, 1)
    port = free_port()
    dead = node.root / "dead-ceph.conf"
    dead.write_text(node.cluster.conf.read_text().replace(
        node.cluster.mon_addr, f"127.0.0.1:{free_port()}"))
    saved = node.config.read_text()
    node.config.write_text(saved.replace(str(node.cluster.conf), str(dead)))
    metrics_config(node, port)
    name = node.name("nomon")
    f = node.write(name, spec(node))
    d = start()
    try:
        d.wait_phase(name, "Unknown")
        s = wait_metric(lambda: scrape(port), "ceph_up 0",
                        lambda s: value(s, "rbd_reconciler_ceph_up") == 0)
        assert value(s, "rbd_reconciler_unknown_volumes") == 1
        assert value(s, "rbd_reconciler_volume_observed_phase", volume=name,
                     phase="Unknown") == 1
        assert d.stop() == 0
    finally:
        f.unlink()  # nothing was done to it: nothing to release
        node.config.write_text(saved)


def test_port_in_use_refuses_to_start(node: NodeUnderTest,
                                      start: Callable[..., Daemon]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        metrics_config(node, busy.getsockname()[1])
        d = start()
        assert d.proc.wait(timeout=30) == 1
        assert "metrics.listen" in d.log.read_text()


def test_csi_calls_counted_by_method_and_code(node: NodeUnderTest,
                                              start_csi: Callable[..., object]) -> None:
    port = free_port()
    c = start_csi(config=f"metrics:\n  listen: \"127.0.0.1:{port}\"\n")
    # Every implemented method is there at 0 once CSI serves, before any call.
    wait_metric(lambda: scrape(port), "CSI methods at 0",
                lambda s: value(s, "rbd_reconciler_csi_calls_total", method="NodeStageVolume",
                                code="OK") == 0
                and value(s, "rbd_reconciler_csi_call_duration_seconds_count",
                          method="ControllerExpandVolume") == 0)
    c.identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=T)  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as err:
        c.controller.CreateVolume(pb.CreateVolumeRequest(), timeout=T)  # type: ignore[attr-defined]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A made-up method is not a label value a client can invent.
    raw = c.channel.unary_unary("/csi.v1.Identity/NoSuchMethod")  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as err:
        raw(b"", timeout=T)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    s = wait_metric(lambda: scrape(port), "CSI calls counted",
                    lambda s: value(s, "rbd_reconciler_csi_calls_total",
                                    method="CreateVolume", code="INVALID_ARGUMENT") == 1)
    assert value(s, "rbd_reconciler_csi_calls_total", method="GetPluginInfo", code="OK") == 1
    assert value(s, "rbd_reconciler_csi_call_duration_seconds_count",
                 method="GetPluginInfo") == 1
    assert not [k for k in s if ("method", "NoSuchMethod") in k[1]]
    assert c.stop() == 0  # type: ignore[attr-defined]
