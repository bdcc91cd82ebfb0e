"""Prometheus metrics for ``rbd-reconciler run``: an HTTP endpoint and the
node_exporter textfile-collector file, both from one private registry.

Label values are volume names and fixed enums only (phases, step kinds,
refusal reasons, CSI methods and codes): never paths, messages or secrets,
which would leak through a scrape and explode cardinality. Per-volume state
is exported as "the current phase = 1" (one series per volume, not one per
volume and phase), computed at scrape time from what the daemon last set.

Imported by daemon/ (7 modules).
"""

from __future__ import annotations

import ipaddress
import logging
import platform
import re
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from reconciler import __version__
from reconciler.apply.logfmt import step_kind
from reconciler.apply.outcomes import MOVED_ON
from reconciler.source.reasons import VERDICTS
from reconciler.state.files import write_atomic

if TYPE_CHECKING:
    from http.server import HTTPServer

    from reconciler.apply.outcomes import VolumeOutcome
    from reconciler.plan.planner import VolumePlan
    from reconciler.spec.model import Volume

log = logging.getLogger("rbd-reconciler")

NS = "rbd_reconciler"
NOT_IN_FLEET = "NotInFleet"  # rbd_reconciler_rollout_state of a node in no fleet
# What a status file's "phase" can say (daemon.py); other values count as Other.
STATUS_PHASES = ("Pending", "Absent", "Created", "Mapped", "Staged", "Published", "Degraded",
                 "Deleting", "Released", "Failed", "Frozen", "Unknown", "Stalled", "Fenced")
# What is wrong with a volume that no step may put right (a plan's problems):
# one series per volume and condition, 1 while it holds.
VOLUME_CONDITIONS = ("Shadowed", "FilesystemReadOnly", "HelperGone")
LIFECYCLE = {"ABSENT": "Absent", "CREATED": "Created", "MAPPED": "Mapped", "STAGED": "Staged",
             "PUBLISHED": "Published"}

# Refusal messages are free text for people; the label is this fixed enum.
# First match wins; the patterns follow the wording in plan.py and apply.py.
REFUSAL_REASONS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (reason, re.compile(rx)) for reason, rx in (
        ("symlink", r"is a symlink"),
        ("dead_mapping", r"the mapping of .* is dead"),
        ("no_device", r"no mapped device|is not a block device"),
        ("no_size", r"does not exist and no size is given"),
        ("shrink", r"^shrinking |larger than its source, never smaller"),
        ("mapper_change", r"remapping would pull it"),
        ("not_owned", r"not created by this node|not made by this node|is owned by|"
                      r"not taken by this node|did not take"),
        ("group_members", r"refusing to change the members"),
        ("has_clones", r"clones depend on it|still has clones"),
        ("has_snapshots", r"has snapshots this node did not make|still has snapshots"),
        ("no_source", r"clone source .*does not exist|cannot see the clone source|"
                      r"its source image .* does not exist|cannot see the restore source|"
                      r"group snapshot .* does not exist|member image .* does not exist"),
        ("stalled", r"nothing that touches it is done until it completes"),
        ("fenced", r"is mapped here but is claimed by node|Ceph has blocklisted the client"),
        ("claimed", r"is claimed by node"),
        ("in_use", r"is open by|still open by"),
        ("foreign_filesystem", r"refusing to format|refusing to mkfs|\(image-meta\), not|"
                               r"has data written to it"),
        ("foreign_mount", r"already has a mount of something else|someone else's mount"),
        ("staging_not_mounted", r"staging path .* is not"),
        ("encryption", r"LUKS2|luksFormat|encryption is never added|the node key does not "
                       r"open|key file |sealed passphrase|wrapped passphrase|^not flattened: |"
                       r"refusing to open it twice|refusing to close it"),
        ("qos", r"^QoS: "),
        ("unknown", r"unknown, not absent"),
        ("moved_on", re.escape(MOVED_ON)),
    ))
REFUSAL_OTHER = "other"


def refusal_reason(message: str | None) -> str:
    for reason, rx in REFUSAL_REASONS:
        if message and rx.search(message):
            return reason
    return REFUSAL_OTHER


PASS_RESULTS = ("ok", "refused", "error")
FAILURE_CRASH = "crash"


def step_kinds() -> tuple[str, ...]:
    """Every step kind the planner can emit, as label values."""
    from reconciler.plan.steps import Step

    def walk(cls: type[Step]) -> Iterator[type[Step]]:
        for sub in cls.__subclasses__():
            yield sub
            yield from walk(sub)
    return tuple(sorted({step_kind(c.action) for c in walk(Step)}))


def ceph_reachable(pools_listed: Iterable[str], pool_errors: dict[str, str]) -> bool | None:
    """From one observation: True once any pool answered or connecting worked
    (a dead pool is not a dead cluster); None when no pool was asked about."""
    if any(True for _ in pools_listed):
        return True
    if not pool_errors:
        return None
    return not all(e.startswith("cannot reach Ceph") for e in pool_errors.values())


class _VolumeStates(Collector):
    """Per-volume phase gauges from dicts the daemon updates (under a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status: dict[str, str] = {}
        self.observed: dict[str, str] = {}
        self.wanted: dict[str, str] = {}
        self.conditions: dict[str, frozenset[str]] = {}
        self.ceph_up: bool | None = None
        self.stall_since: dict[str, float] = {}  # Stalled volumes: nothing completed since

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.lock:
            status, observed, wanted = dict(self.status), dict(self.observed), dict(self.wanted)
            conditions = dict(self.conditions)
            ceph_up, stall_since = self.ceph_up, dict(self.stall_since)
        for name, doc, states in (
                ("volume_phase", "The phase the volume's status reports (1 = current).", status),
                ("volume_observed_phase", "The lifecycle phase last observed on the node "
                                          "(1 = current).", observed),
                ("volume_wanted_phase", "The lifecycle phase the spec wants (1 = current).",
                 wanted)):
            g = GaugeMetricFamily(f"{NS}_{name}", doc, labels=["volume", "phase"])
            for vol, phase in sorted(states.items()):
                g.add_metric([vol, phase], 1)
            yield g
        cond = GaugeMetricFamily(f"{NS}_volume_condition", "1 while the condition holds for the "
                                 "volume (Shadowed: a publish with someone else's mount on "
                                 "top; FilesystemReadOnly: its filesystem refuses writes; "
                                 "HelperGone: its rbd-fuse died and the volume is in use).",
                                 labels=["volume", "condition"])
        for vol, active in sorted(conditions.items()):
            for c in VOLUME_CONDITIONS:
                cond.add_metric([vol, c], 1 if c in active else 0)
        yield cond
        counts = GaugeMetricFamily(f"{NS}_volumes", "Volumes by the phase their status reports.",
                                   labels=["phase"])
        for phase in STATUS_PHASES:
            counts.add_metric([phase], sum(1 for p in status.values() if p == phase))
        yield counts
        since = GaugeMetricFamily(f"{NS}_volume_io_stalled_since_timestamp_seconds",
                                  "Stalled volumes: unix time from which no I/O to the mapped "
                                  "device has completed (one series per stalled volume).",
                                  labels=["volume"])
        for vol, t in sorted(stall_since.items()):
            since.add_metric([vol], t)
        yield since
        up = GaugeMetricFamily(f"{NS}_ceph_up", "1 when the last observation that needed Ceph "
                                                "reached it, 0 when it could not connect.")
        if ceph_up is not None:  # never asked yet: no sample rather than a guess
            up.add_metric([], 1 if ceph_up else 0)
        yield up


def disable_created_metrics() -> None:
    """prometheus_client.disable_created_metrics(), from 0.17; Debian 12's
    python3-prometheus-client is 0.16, where the function is missing but the
    switch it sets (read at every collect) is the same module global."""
    disable = getattr(prometheus_client, "disable_created_metrics", None)
    if disable is not None:
        disable()
    else:
        prometheus_client.metrics._use_created = False  # type: ignore[attr-defined]



# Why a sync of the GitOps source applied nothing new (source/reasons.py, the
# one table of them): their series exist from the start, at 0.
SOURCE_FAILURE_REASONS = tuple(r for r, v in VERDICTS.items() if v.kind != "command")

class Metrics:
    """One daemon's metrics, in a registry of its own (tests run several)."""

    def __init__(self) -> None:
        # *_created samples would double every counter's and histogram's
        # series for a start time nobody alerts on (process-wide: fine here).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.states = _VolumeStates()
        r.register(self.states)
        self.passes = Counter(f"{NS}_passes", "Passes run, by result (ok: the pass ran to the "
                              "end; refused: preflight or an untrusted directory; error: a bug).",
                              ["result"], registry=r)
        self.pass_seconds = Histogram(f"{NS}_pass_duration_seconds", "Time one pass took "
                                      "(load, observe, plan, submit; not the steps).", registry=r,
                                      buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.last_success = Gauge(f"{NS}_last_successful_pass_timestamp_seconds",
                                  "Unix time the last pass that ran to the end finished.",
                                  registry=r)
        self.step_seconds = Histogram(f"{NS}_step_duration_seconds",
                                      "Time each executed step took, by step kind.", ["action"],
                                      registry=r, buckets=(.005, .01, .025, .05, .1, .25, .5, 1,
                                                           2.5, 5, 10, 30, 60, 120))
        self.refusals = Counter(f"{NS}_refusals", "Safety refusals, at plan or apply time, by "
                                "reason.", ["reason"], registry=r)
        self.failures = Counter(f"{NS}_failures", "Failed volume chains (not refusals), by the "
                                "kind of the step that failed (crash: apply itself failed).",
                                ["reason"], registry=r)
        self.backoffs = Counter(f"{NS}_backoffs", "Backoffs scheduled after a failed chain.",
                                registry=r)
        self.reattachments = Counter(f"{NS}_nbd_reattachments", "rbd-nbd helpers started "
                                     "again for a device the kernel kept after its rbd-nbd "
                                     "died, by volume.", ["volume"], registry=r)
        self.rolls = Counter(f"{NS}_nbd_rolls", "rbd-nbd helpers replaced by one of the "
                             "binary on disk after a package upgrade replaced theirs, by "
                             "volume.", ["volume"], registry=r)
        self.in_backoff = Gauge(f"{NS}_volumes_in_backoff", "Volumes waiting out a backoff.",
                                registry=r)
        self.frozen_files = Gauge(f"{NS}_frozen_files", "Desired files that fail to load (their "
                                  "volumes are frozen).", registry=r)
        self.unknown = Gauge(f"{NS}_unknown_volumes", "Volumes that could not be observed.",
                             registry=r)
        self.state_writable = Gauge(f"{NS}_state_dir_writable", "0 while a record or status "
                                    "under stateDir cannot be written (full, read-only): new "
                                    "and changed volumes wait; else 1.", registry=r)
        self.state_writable.set(1)
        self.csi_calls = Counter(f"{NS}_csi_calls", "CSI calls, by method and gRPC status code.",
                                 ["method", "code"], registry=r)
        self.csi_seconds = Histogram(f"{NS}_csi_call_duration_seconds", "CSI call latency, by "
                                     "method.", ["method"], registry=r,
                                     buckets=(.005, .01, .05, .1, .5, 1, 5, 10, 30, 60, 120))
        # For alerts that scale with the config ("no successful pass for 3 x resync").
        self.resync = Gauge(f"{NS}_resync_interval_seconds", "The configured resyncSeconds.",
                            registry=r)
        # The GitOps source (docs/gitops-source.md); no series without one.
        self.source_info = Gauge(f"{NS}_source_info", "Always 1 while a source is followed; "
                                 "the labels name the applied revision.",
                                 ["url", "ref", "revision"], registry=r)
        self.source_fetch = Gauge(f"{NS}_source_last_fetch_timestamp_seconds",
                                  "Unix time the remote last answered a fetch or a look.",
                                  registry=r)
        self.source_success = Gauge(f"{NS}_source_last_success_timestamp_seconds",
                                    "Unix time of the last sync that ended with the remote's "
                                    "revision verified and applied (or already applied).",
                                    registry=r)
        self.source_refusals = Counter(f"{NS}_source_failures", "Syncs that applied nothing "
                                       "new, by reason (Unsigned, UnknownSigner, Revoked, "
                                       "WrongFormat, NotDescendant, LoadFailed, FetchFailed, "
                                       "...).", ["reason"], registry=r)
        self.source_interval = Gauge(f"{NS}_source_interval_seconds",
                                     "The configured source.intervalSeconds.", registry=r)
        # A fleet's rollout (source.fleet): one series, the state now; from
        # start-up (an alert reads it), NotInFleet until the node is in one.
        self.unaccounted = Gauge(f"{NS}_unaccounted", "Things on the node that look like "
                                 "ours and that no volume file or record accounts for, by kind "
                                 "and whether they are provably ours (release --orphans "
                                 "removes those); kind=\"unknown\": what could not be listed.",
                                 ["kind", "ours"], registry=r)
        self.rollout = Gauge(f"{NS}_rollout_state", "Always 1; state: NotInFleet, Applied, "
                             "Waiting, OutsideWindow, Halted or Held; revision: the revision "
                             "held back (empty: none).",
                             ["state", "revision"], registry=r)
        self._rollout: tuple[str, str] | None = None
        self.set_rollout(None, None)
        self.build_info = Gauge(f"{NS}_build_info", "Always 1; the labels say which build "
                                "runs.", ["version", "python"], registry=r)
        self.build_info.labels(__version__, platform.python_version()).set(1)
        self.http: HTTPServer | None = None
        self._zero_series()

    def _zero_series(self) -> None:
        """Every label value known at start gets its series now, at 0: an
        alert on a series that does not exist yet never fires, and rate()
        misses the first event of a series born with it."""
        for result in PASS_RESULTS:
            self.passes.labels(result)
        for reason, _ in REFUSAL_REASONS:
            self.refusals.labels(reason)
        self.refusals.labels(REFUSAL_OTHER)
        for kind in step_kinds():
            self.step_seconds.labels(kind)
            self.failures.labels(kind)
        self.failures.labels(FAILURE_CRASH)
        for reason in SOURCE_FAILURE_REASONS:  # RbdSourceRefused selects on these
            self.source_refusals.labels(reason)
        self.unaccounted.labels("any", "true")  # RbdLeftoversOfOurs sums these

    def set_unaccounted(self, counts: dict[tuple[str, bool], int]) -> None:
        """The leftovers of the last look (engine/orphans.py), replacing the last."""
        self.unaccounted.clear()
        self.unaccounted.labels("any", "true")
        for (kind, ours), n in counts.items():
            self.unaccounted.labels(kind, "true" if ours else "false").set(n)

    def csi_served(self, methods: Iterable[str]) -> None:
        """The CSI methods the adapter implements, at 0, once it serves
        them (error codes appear with their first call: a method x code
        grid of zeros would be hundreds of series nobody reads)."""
        for method in methods:
            self.csi_calls.labels(method, "OK")
            self.csi_seconds.labels(method)

    def csi_call(self, method: str, code: str, seconds: float) -> None:
        self.csi_calls.labels(method, code).inc()
        self.csi_seconds.labels(method).observe(seconds)

    def set_rollout(self, state: str | None, revision: str | None) -> None:
        """The node's rollout state now (None: in no fleet: NotInFleet)."""
        now = (state or NOT_IN_FLEET, revision or "")
        if now == self._rollout:
            return
        self.rollout.clear()
        self.rollout.labels(*now).set(1)
        self._rollout = now

    # -- per-volume state -------------------------------------------------------
    def set_phase(self, name: str, phase: str, stalled_since: float | None = None) -> None:
        with self.states.lock:
            self.states.status[name] = phase if phase in STATUS_PHASES else "Other"
            if stalled_since is not None:
                self.states.stall_since[name] = stalled_since
            else:
                self.states.stall_since.pop(name, None)

    def observed(self, plans: Iterable[VolumePlan], volumes: Iterable[Volume],
                 ceph_up: bool | None) -> None:
        with self.states.lock:
            for vp in plans:
                self.states.observed[vp.name] = ("Unknown" if vp.unknown
                                                 else LIFECYCLE[vp.phase.name])
                if vp.kind == "volume":
                    self.states.conditions[vp.name] = frozenset(vp.problems)
            for v in volumes:
                self.states.wanted[v.name] = LIFECYCLE[v.wanted_phase.name]
            if ceph_up is not None:
                self.states.ceph_up = ceph_up

    def retain(self, names: set[str]) -> None:
        """Forget volumes no longer managed (released, or never ours)."""
        with self.states.lock:
            tables: tuple[dict[str, Any], ...] = (
                self.states.status, self.states.observed, self.states.wanted,
                self.states.conditions, self.states.stall_since)
            for d in tables:
                for name in [n for n in d if n not in names]:
                    del d[name]

    # -- events -------------------------------------------------------------------
    def outcome(self, vp: VolumePlan, out: VolumeOutcome, crashed: bool = False) -> None:
        for s in out.steps:
            self.step_seconds.labels(step_kind(s.step.action)).observe(s.seconds)
            if s.step.action == "reattach" and s.status == "changed":
                self.reattachments.labels(s.step.volume).inc()
            if s.step.action == "roll" and s.status == "changed":
                self.rolls.labels(s.step.volume).inc()
        for why in ([vp.refusal] if vp.refusal else []) + list(vp.withheld):
            self.refusals.labels(refusal_reason(why)).inc()
        if out.refused:  # a safety check at execution time
            self.refusals.labels(refusal_reason(out.error)).inc()
        elif out.status == "failed" and not vp.refused:
            failed = [s for s in out.steps if s.status == "failed"]
            self.failures.labels(FAILURE_CRASH if crashed or not failed
                                 else step_kind(failed[-1].step.action)).inc()
        if out.status == "failed":
            self.backoffs.inc()

    def pass_done(self, seconds: float, result: str) -> None:
        self.passes.labels(result).inc()
        self.pass_seconds.observe(seconds)
        if result == "ok":
            self.last_success.set(time.time())

    # -- exposition -----------------------------------------------------------------
    def serve(self, listen: str) -> None:
        host, port = parse_listen(listen)
        self.http, _thread = prometheus_client.start_http_server(port, host,
                                                                 registry=self.registry)
        log.info("metrics served on http://%s/metrics", listen_url(host, port))
        if not is_loopback(host):
            log.warning("metrics.listen %s is not loopback: /metrics has no authentication and "
                        "names every volume", listen)

    def stop(self) -> None:
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            self.http = None

    def write_textfile(self, path: Path) -> None:
        """node_exporter's textfile collector reads ``*.prom``: write a temp
        file beside it (never matching *.prom) and rename, so it never reads
        half a file. A failure is logged, never raised: metrics are not worth
        a pass."""
        try:
            data = prometheus_client.generate_latest(self.registry)
            # 0644: node_exporter usually runs as another user, and often owns
            # the directory: write_atomic acts only through descriptors there.
            write_atomic(path, data, mode=0o644)
        except OSError as exc:
            log.warning("metrics: cannot write %s: %s", path, exc)


DEFAULT_HOST = "127.0.0.1"


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, ``:port`` or ``port``; no host means
    loopback (the endpoint is unauthenticated: exposing it is a choice)."""
    m = re.fullmatch(r"(?:(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]*):)?([0-9]{1,5})", listen)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"metrics.listen {listen!r}: expected HOST:PORT (port 1-65535)")
    host = (m.group(1) or DEFAULT_HOST).strip("[]")
    return host, int(m.group(2))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it reaches the network
        return False


def listen_url(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
