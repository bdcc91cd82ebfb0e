"""What the daemon does for the command line (README: The command line
beside the daemon): each request of the control socket (daemon/control.py),
answered from the daemon's passes and its live view, under its own locks.

- ``apply``, ``release`` and ``allow-removal`` are asks of the passes
  (daemon/asks.py): each volume's steps are sent as its chain ends, then a
  recap, as ``apply`` prints them.
- ``status``, ``plan`` and ``explain`` answer from a look begun after the
  question (daemon/liveview.py): the files as the daemon loaded them, the
  node and Ceph as they are now, planned as the command alone plans them,
  so both say the same; the answer says who looked and when.
- ``rotate-key`` and ``takeover`` run here while the daemon holds the
  volume: no chain of it runs meanwhile, and it is looked at right after
  (rotate-key looks at it first too: where it is mapped).
- ``fleet-status`` reads the fleet's reports on this connection's thread,
  into the sightings the daemon's gate keeps (daemon/rollout.py): healthy
  times and a report's age on this node's clock since its first read.

Imported by daemon/service.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from reconciler.apply.rotate import mapped_device, rotate_key
from reconciler.apply.takeover import takeover
from reconciler.daemon.asks import Ask, Asks, Inflight, Kind
from reconciler.daemon.control import Reply
from reconciler.daemon.liveview import LiveView, Looked
from reconciler.daemon.rollout import Rollouts
from reconciler.drivers.freeze import left_frozen
from reconciler.engine import context, look, orphans
from reconciler.engine.fleet import FleetUnavailable, NotInFleet
from reconciler.observe.ceph import observe_images
from reconciler.observe.node import Node
from reconciler.plan.types import VolumePlan
from reconciler.spec.config import Config
from reconciler.spec.loader import LoadResult
from reconciler.spec.model import Volume
from reconciler.state.allowance import Allowance
from reconciler.state.registry import freezes_recorded
from reconciler.views import (
    Selection,
    answered,
    claim_doc,
    daemon_status,
    explain_exit,
    explanation,
    plan_doc,
    plan_exit,
    select,
    status_exit,
    status_of,
)

log = logging.getLogger("rbd-reconciler.control")

# A line for the operator, and whether it is an error (stderr).
Say = Callable[[str, bool], None]
# A job's work, given its volume's name: True when done.
Job = Callable[[str, Say], bool]

# How often a thread waiting for an ask's next event looks whether its client
# went away (the keepalive's failed send says so): then it stops waiting.
GONE_CHECK_S = 1.0


class Running(Protocol):
    """What of the running daemon the commands use (daemon/service.py)."""

    config: Config  # replaced by a reload: read at each use
    node: Node
    asks: Asks
    view: LiveView
    rollout: Rollouts
    records: dict[str, dict[str, Any]]
    stopping: threading.Event
    lock: threading.Lock
    inflight_info: dict[str, Inflight]
    passes_done: int
    not_reconciling: str | None  # why its last pass refused to look

    def first_pass_after_now(self) -> int: ...

    def wait_pass(self, number: int, deadline: float) -> bool: ...

    def look_again(self, names: set[str] | None, why: str) -> None: ...

    def unreserve(self, name: str) -> None: ...


class Commands:
    def __init__(self, daemon: Running) -> None:
        self.d = daemon

    def handle(self, request: dict[str, Any], reply: Reply) -> None:
        config = self.d.config
        command, args = request["command"], request.get("args") or {}
        if command == "ping":
            reply.finish(0, result={"pid": os.getpid(), "stateDir": str(config.state_dir),
                                    "connections": reply.others()})
            return
        theirs = request.get("stateDir")
        if not isinstance(theirs, str) or \
                os.path.normpath(theirs) != os.path.normpath(config.state_dir):
            # Another node config than this daemon's: the client works alone.
            reply.finish(1, elsewhere=f"this daemon serves stateDir {config.state_dir}")
            return
        log.info("control: %s %s", command, "" if command == "fleet-status" else _said(args))
        handler = {
            "apply": lambda: self._ask("apply", _targets(args), reply),
            "release": lambda: self._ask("release", _targets(args), reply),
            "allow-removal": lambda: self._allow_removal(args, reply),
            "status": lambda: self._status(_targets(args), reply),
            "plan": lambda: self._plan(_targets(args), reply),
            "explain": lambda: self._explain(_name(args), reply),
            "rotate-key": lambda: self._job(_name(args), reply, self._rotate(args)),
            "takeover": lambda: self._job(_name(args), reply, self._takeover(args)),
            "fleet-status": lambda: self._fleet(reply),
        }[command]
        handler()

    # -- asks of the passes -------------------------------------------------------
    def _ask(self, kind: Kind, targets: list[dict[str, str]], reply: Reply,
             allowance: Allowance | None = None) -> None:
        ask = Ask(kind, targets, self.d.first_pass_after_now(), allowance)
        self.d.asks.add(ask)
        names = {t["name"] for t in targets if "name" in t}
        every = not targets and kind == "apply"
        self.d.look_again(None if every else names, f"{kind} asked by the command line")
        self._stream(ask, reply)

    def _stream(self, ask: Ask, reply: Reply) -> None:
        while (ev := _next(ask, reply)) is not None:
            if "exit" in ev:
                final = dict(ev)
                reply.finish(final.pop("exit"), **final)
                return
            if not reply.send(ev):
                return
        # The client went away; the ask goes on without it.

    def _allow_removal(self, args: dict[str, Any], reply: Reply) -> None:
        names = [str(n) for n in args.get("names") or []]
        every = bool(args.get("all"))
        if not names and not every:
            reply.finish(1, error="allow-removal needs NAME... or --all")
            return
        unknown = [n for n in names if n not in self.d.records]
        if unknown:
            reply.finish(1, error=f"not managed by the daemon: {', '.join(unknown)}")
            return
        what = "every pending removal" if every else ", ".join(sorted(names))
        reply.event("say", text=f"allowed: {what}; the daemon lets them go now")
        self._ask("removal", [], reply, Allowance(frozenset(names), every))

    # -- the live view ------------------------------------------------------------
    def _loaded(self, reply: Reply) -> LoadResult | None:
        """The files as the daemon's last pass loaded them (what it converges
        the node to), once it has made one; None: answered (alone, or why not)."""
        d = self.d
        deadline = time.monotonic() + self._budget()
        if d.passes_done == 0 and not d.wait_pass(1, deadline):
            reply.finish(1, alone="the daemon has not finished its first pass yet")
            return None
        if d.not_reconciling is not None or d.view.loaded is None:
            # Its view is not what is there now (an untrusted directory, no
            # source revision yet): the command looks for itself, and says why.
            reply.finish(1, alone=d.not_reconciling or "the daemon has loaded nothing yet")
            return None
        return d.view.loaded

    def _budget(self) -> float:
        """How long a view command waits in the daemon: one look ahead of its
        own and its own (each bounded by observeTimeoutSeconds), and a little."""
        return 2 * self.d.config.observe_timeout_seconds + 2.0

    def _look(self, loaded: LoadResult, names: set[str] | None, all_watchers: bool,
              asked: float, reply: Reply) -> Looked | None:
        """A look begun after the question; None: answered (the command looks
        alone: the look before it did not end in time, or this one failed)."""
        # The look ahead of this one gets what is left once this one's own
        # (bounded by observeTimeoutSeconds) is set aside: the budget holds.
        ahead = asked + self._budget() - self.d.config.observe_timeout_seconds - 1.0
        try:
            looked = self.d.view.look(loaded, names, all_watchers, asked,
                                      ahead - time.monotonic())
        except Exception as exc:  # a driver bug: the command's own look may still answer
            log.exception("control: the look for a view failed")
            reply.finish(1, alone=f"the daemon's look failed ({type(exc).__name__}: {exc})")
            return None
        if looked is None:
            reply.finish(1, alone="the daemon's look at the node did not end in time")
        return looked

    def _selected(self, targets: list[dict[str, str]], reply: Reply
                  ) -> tuple[LoadResult, Selection] | None:
        """The loaded files and what ``targets`` pick in them; None: answered."""
        loaded = self._loaded(reply)
        if loaded is None:
            return None
        sel = select(loaded.volumes, loaded.frozen_names, loaded.failed_files,
                     loaded.diagnostics, targets, loaded.frozen_in)
        if sel.missing:
            reply.finish(1, error=f"no volume {', '.join(sel.missing)} in the daemon's "
                                  "desiredDir or csi.dir")
            return None
        return loaded, sel

    def _status(self, targets: list[dict[str, str]], reply: Reply) -> None:
        asked = time.monotonic()
        picked = self._selected(targets, reply)
        if picked is None:
            return
        loaded, sel = picked
        looked = self._look(loaded, set(sel.names) if targets else None, True, asked, reply)
        if looked is None:
            return
        p, config = looked.result, self.d.config
        doc = status_of(config, context(config, self.d.node), p.loaded, p.observed,
                        _only(p.plans, sel, targets), sel.errors)
        if not targets:  # the node's leftovers: a status of the whole node only
            doc["unaccounted"] = orphans.find(config, self.d.node, loaded).as_dict()
        reply.finish(status_exit(doc), result={"kind": "status", "doc": self._by(doc, looked)})

    def _plan(self, targets: list[dict[str, str]], reply: Reply) -> None:
        asked = time.monotonic()
        picked = self._selected(targets, reply)
        if picked is None:
            return
        loaded, sel = picked
        looked = self._look(loaded, set(sel.names) if targets else None, False, asked, reply)
        if looked is None:
            return
        with self.d.lock:
            running = {n for n, i in self.d.inflight_info.items() if i.purpose != "job"}
        state_dir = self.d.config.state_dir
        left = left_frozen(state_dir) if freezes_recorded(state_dir) else []
        doc = plan_doc(_only(looked.result.plans, sel, targets), sel.errors,
                       [(r.path, r.owner) for r in left], running)
        reply.finish(plan_exit(doc), result={"kind": "plan", "doc": self._by(doc, looked)})

    def _explain(self, name: str, reply: Reply) -> None:
        asked = time.monotonic()
        loaded = self._loaded(reply)
        if loaded is None:
            return
        config = self.d.config
        if loaded.refused:
            reply.finish(1, error="the desired directory is not trusted: " + "; ".join(
                str(d) for d in loaded.diagnostics))
            return
        vol = next((v for v in loaded.volumes if v.name == name), None)
        frozen = name in loaded.frozen_names
        daemon = daemon_status(config)(name)
        if vol is None and not frozen and daemon is None:
            reply.finish(1, error=f"no volume {name!r} in {config.desired_dir}")
            return
        looked = self._look(loaded, {name}, True, asked, reply)
        if looked is None:
            return
        p = looked.result
        vp = next((x for x in p.plans if x.name == name), None)
        doc = explanation(name, vol, vp, p.observed, context(config, self.d.node), frozen,
                          loaded.diagnostics, daemon,
                          lambda actual: claim_doc(actual, lambda: self._blocklist(vol)))
        reply.finish(explain_exit(doc), result={"kind": "explain", "doc": self._by(doc, looked)})

    def _fleet(self, reply: Reply) -> None:
        at = time.time()
        try:
            doc = self.d.rollout.fleet_view()
        except NotInFleet as exc:  # the command's own config may say otherwise: its read
            reply.finish(1, alone=f"the daemon is in no fleet: {exc}")
            return
        except FleetUnavailable as exc:
            reply.finish(1, error=f"fleet status: cannot read the reports: {exc}")
            return
        reply.finish(0, result={"kind": "fleet", "doc": answered(
            doc, f"the daemon (pid {os.getpid()})", at)})

    def _blocklist(self, vol: Volume | None) -> dict[str, str]:
        """Ceph's blocklist, through the daemon's connection, bounded like a
        look's (asked only when a claim's holder must be judged)."""
        node = self.d.node
        if vol is None or vol.kind != "Volume" or not vol.image.pool:
            raise RuntimeError("no image to ask Ceph about")
        view = observe_images(node.config.ceph, [(vol.image.pool, vol.image.name)],
                              node.config.observe_timeout_seconds, set(), node.ceph_session,
                              blocklist=True)
        if view.blocklist is None:
            raise RuntimeError("Ceph did not answer for its blocklist in time")
        return dict(view.blocklist)

    @staticmethod
    def _by(doc: dict[str, Any], looked: Looked) -> dict[str, Any]:
        return answered(doc, f"the daemon (pid {os.getpid()})", looked.at)

    # -- jobs under the daemon's hold on a volume ---------------------------------
    def _job(self, name: str, reply: Reply, work: Job) -> None:
        ask = Ask("job", [{"name": name}], self.d.first_pass_after_now())
        self.d.asks.add(ask)
        self.d.look_again({name}, f"{name}: a job of the command line")
        while (ev := _next(ask, reply)) is not None:
            if "exit" in ev:
                final = dict(ev)
                reply.finish(final.pop("exit"), **final)
                return
            if ev.get("event") == "reserved":
                break
        else:
            self._abandon(ask, name)
            return
        vol = ask.reserved
        assert vol is not None
        try:
            if not reply.event("reserved"):
                return  # nobody waits for it any more: not done
            ok = work(name, lambda text, err: reply.event(
                "say", text=text, stream="err" if err else "out"))
            reply.finish(0 if ok else 1)
        finally:
            self.d.unreserve(name)

    def _abandon(self, ask: Ask, name: str) -> None:
        """Its client went away before the volume was held: the job is not
        done. Dropped under the asks' lock, so no pass reserves it later; one
        that did already gives the volume back."""
        self.d.asks.drop(ask)
        if ask.reserved is not None:
            self.d.unreserve(name)
        log.info("control: %s: a job dropped: its client went away before it began", name)

    def _rotate(self, args: dict[str, Any]) -> Job:
        new_key_file = args.get("newKeyFile")

        def work(name: str, say: Say) -> bool:
            loaded = self.d.view.loaded
            vol = next((v for v in loaded.volumes if v.name == name), None) if loaded else None
            if vol is None or vol.kind != "Volume":
                say(f"rbd-reconciler: no volume {name!r} in {self.d.config.desired_dir}", True)
                return False
            # Looked at now, under the daemon's hold (the last pass may have
            # seen it before the chain that mapped it): where it is mapped.
            device = mapped_device(vol, look([vol], self.d.config, self.d.node).observed)
            if device is None:
                say(f"rbd-reconciler: {vol.image.spec} is not mapped on this node; rotate-key "
                    "works on the mapped device (the daemon maps it first)", True)
                return False
            return rotate_key(self.d.config, vol, device, self.d.node.crypt,
                              str(new_key_file) if new_key_file else None, say)
        return work

    def _takeover(self, args: dict[str, Any]) -> Job:
        sure = bool(args.get("sure"))

        def work(name: str, say: Say) -> bool:
            loaded = self.d.view.loaded
            vol = next((v for v in loaded.volumes if v.name == name), None) if loaded else None
            if vol is None or vol.kind != "Volume":
                say(f"rbd-reconciler: no volume {name!r} in {self.d.config.desired_dir}", True)
                return False
            return takeover(self.d.config, vol, sure, say, "the daemon maps it here now")
        return work


def _only(plans: list[VolumePlan], sel: Selection, targets: list[dict[str, str]]
          ) -> list[VolumePlan]:
    """The plans of what was asked (a look may have served a wider question)."""
    if not targets:
        return plans
    names = set(sel.names)
    return [vp for vp in plans if vp.name in names]


def _next(ask: Ask, reply: Reply) -> dict[str, Any] | None:
    """The ask's next event; None once its client is gone (the keepalive
    finds that out within KEEPALIVE_S)."""
    while not reply.gone:
        ev = ask.next_event(GONE_CHECK_S)
        if ev is not None:
            return ev
    return None


def _targets(args: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    for t in args.get("targets") or []:
        if isinstance(t, dict) and isinstance(t.get("name"), str):
            out.append({"name": t["name"]})
        elif isinstance(t, dict) and isinstance(t.get("path"), str) and t["path"].startswith("/"):
            out.append({"path": t["path"]})
        else:
            raise ValueError(f"a target is a name or an absolute path, not {t!r}")
    return out


def _name(args: dict[str, Any]) -> str:
    name = args.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("no volume name")
    return name


def _said(args: dict[str, Any]) -> str:
    """The request's arguments for the log line (names and paths only)."""
    targets = args.get("targets") or []
    parts = [t.get("name") or t.get("path") for t in targets if isinstance(t, dict)]
    parts += [str(args["name"])] if args.get("name") else []
    parts += [str(n) for n in args.get("names") or []]
    return " ".join(str(p) for p in parts) or "(every volume)"
