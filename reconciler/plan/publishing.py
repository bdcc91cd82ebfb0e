"""The planner's rules for publishing (pure; no I/O): a bind of the staging
path to each publish path, remounted when its options drift; a bind that
someone else's mount shadows reported, never unmounted.

Mixed into the volume planner by plan/planner.py; imported by it only.
"""

from __future__ import annotations

from reconciler.plan.steps import Publish, Remount
from reconciler.plan.volumeview import VolumeView, missing_options
from reconciler.spec import mountflags


class PublishRules(VolumeView):
    def forward_publish(self) -> None:
        v, st = self.v, self.v.stage
        assert st is not None
        ours = {m.mount_point: m for m in self.published_targets()}
        shadowed = []
        for p in v.publish:
            m = ours.get(p.path)
            want = mountflags.bind_options(st.mount_options, p.mount_options, st.mode == "block")
            if m is None:
                self.check_path_free(p.path, "publish")
                self.add(Publish(v.name, st.path, p.path, st.mode, p.read_only, want))
                continue
            if (top := self.shadowed_by(m)) is not None:
                # Someone else's mount: never unmounted (safety rule 8), and a
                # remount by path would act on it, not on ours.
                where = ("on top of it" if top.mount_point == p.path
                         else f"at {top.mount_point}, above it")
                shadowed.append(f"{p.path} is not served: {top.fs_type} {top.source} is "
                                f"mounted {where}")
                continue
            if m.read_only != p.read_only or missing_options(m, want, None):
                self.add(Remount(v.name, p.path, tuple(sorted(m.options)),
                                 ("ro" if p.read_only else "rw", *want), bind=True))
        if shadowed:
            self.plan.problems["Shadowed"] = (
                "; ".join(shadowed) + ": applications there write into that mount, not the "
                "volume. It is someone else's and is left alone: unmount it by hand "
                "(docs/troubleshooting.md, RbdPublishShadowed)")
