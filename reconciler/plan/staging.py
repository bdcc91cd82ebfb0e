"""The planner's rules for staging (pure; no I/O): our LUKS2 container
formatted and opened, the filesystem made only on a device proven blank,
the staging mount made or remounted, a grown filesystem grown; one gone
read-only reported, never remounted read-write.

Mixed into the volume planner by plan/planner.py; ``GROW_SLACK`` is also
read by apply/runner.py (the same slack at apply time).

Imported by apply/devicesteps.py; plan/planner.py.
"""

from __future__ import annotations

from reconciler.facts import meta
from reconciler.facts.luks import crypt_name
from reconciler.facts.observed import Mount
from reconciler.plan.steps import (
    FormatCrypt,
    FormatDevice,
    GrowFilesystem,
    MountStaging,
    OpenCrypt,
    Remount,
    ResizeCrypt,
)
from reconciler.plan.types import Refused
from reconciler.plan.volumeview import VolumeView, missing_options
from reconciler.spec import mountflags
from reconciler.spec.units import format_size

# A filesystem this much smaller than its device is grown; less is alignment slack.
GROW_SLACK = 16 * 2**20


class StageRules(VolumeView):
    def forward_crypt(self, new_size: int | None) -> None:
        """Open the volume's LUKS2 container before staging; luksFormat it first
        when the mapped device is proven blank (again at apply time)."""
        v, enc = self.v, self.v.encryption
        assert enc is not None
        name = crypt_name(v.name)
        raw = self.raw
        if self.crypt is not None:
            c = self.crypt
            if c.name != name:
                raise Refused(f"{c.path} (LUKS2, not opened by this reconciler) is open over "
                              f"{c.raw}; refusing to stage through it")
            size = new_size if new_size is not None else raw.size if raw else None
            off = raw.luks_offset if raw else None
            if size is not None and off is not None and size - off > c.size:
                self.add(ResizeCrypt(v.name, name, c.size, size - off, enc.key_kind,
                                     enc.key_path, v.image.pool, v.image.name))
            return
        img_meta = self.img.meta if self.img else {}
        luks_done = img_meta.get(meta.CRYPT_FORMATTED)
        interrupted = bool(img_meta.get(meta.CRYPT_FORMATTING)) and not luks_done
        fmt = FormatCrypt(v.name, raw.path if raw else None, v.image.pool, v.image.name,
                          enc.key_kind, enc.key_path)
        if raw is not None:
            if raw.fs_type == "crypto_LUKS":
                pass
            elif interrupted:
                self.add(fmt)  # our own luksFormat was cut off
            elif raw.signature:
                raise Refused(f"{raw.path} ({v.image.spec}) carries {raw.signature}, not "
                              "LUKS2: encryption is never added to an image that holds "
                              "data; refusing to format it (fix by hand)")
            elif luks_done or img_meta.get(meta.FORMATTED):
                raise Refused(f"{v.image.spec} was formatted "
                              f"{luks_done or img_meta.get(meta.FORMATTED)} by this reconciler "
                              f"but {raw.path} shows no signature now; refusing to format "
                              "over possible data")
            else:
                self.add(fmt)
        elif img_meta.get(meta.FORMATTED) and not luks_done:
            raise Refused(f"{v.image.spec} holds a plain {img_meta[meta.FORMATTED]} "
                          "(image-meta): encryption is never added to an image that holds "
                          "data")
        elif not luks_done:
            self.add(fmt)
        self.add(OpenCrypt(v.name, raw.path if raw else None, name, v.image.pool,
                           v.image.name, enc.key_kind, enc.key_path))

    def forward_stage(self, new_size: int | None) -> None:
        v, st = self.v, self.v.stage
        assert st is not None
        if v.encryption is not None:
            self.forward_crypt(new_size)
            if new_size is not None and self.raw is not None and self.raw.luks_offset:
                new_size -= self.raw.luks_offset  # the plaintext the filesystem can span
            elif new_size is not None and self.dev is None:
                new_size = None  # opened in this run: its size is known once open
        elif self.crypt is not None:
            raise Refused(f"{self.crypt.path} (LUKS2) is open over {self.crypt.raw}, but the "
                          "spec has no encryption: refusing to stage the container itself. "
                          "Put the encryption section back, or release the volume")
        device = self.dev.path if self.dev else None
        img_meta = self.img.meta if self.img else {}
        encrypted = v.encryption is not None
        if st.mode == "block":
            want = mountflags.stage_options((), block=True)
            if not self.is_staged():
                self.check_path_free(st.path, "staging")
                self.add(MountStaging(v.name, device, st.path, "block", None, want, False))
            elif (m := self.obs.mounts_by_point.get(st.path)) is not None and \
                    missing_options(m, want, None):
                # Made by an older version (or by hand) without nosuid.
                self.add(Remount(v.name, st.path, tuple(sorted(m.options)),
                                 ("ro" if m.read_only else "rw", *want), bind=True))
            return
        assert st.fs_type is not None
        formatted = img_meta.get(meta.FORMATTED)
        interrupted = bool(img_meta.get(meta.FORMATTING)) and not formatted
        fs_size = None
        if self.dev is not None:
            found = self.dev.fs_type
            if interrupted:
                # Our own mkfs was cut off; the image was never staged since.
                self.add(FormatDevice(v.name, device, st.fs_type, st.mkfs_options,
                                      v.image.pool, v.image.name, encrypted))
            elif found == st.fs_type:
                fs_size = self.dev.fs_size
            elif self.dev.signature:
                raise Refused(f"{self.dev.path} ({v.image.spec}) carries {self.dev.signature}, "
                              f"not {st.fs_type}; refusing to format over it (fix by hand)")
            elif formatted:
                raise Refused(f"{v.image.spec} was formatted {formatted} by this reconciler "
                              f"but {self.dev.path} shows no filesystem now; refusing to mkfs "
                              "over possible data")
            else:
                self.add(FormatDevice(v.name, device, st.fs_type, st.mkfs_options,
                                      v.image.pool, v.image.name, encrypted))
        elif formatted and formatted != st.fs_type:
            raise Refused(f"{v.image.spec} holds {formatted} (image-meta), not {st.fs_type}")
        elif not formatted:
            self.add(FormatDevice(v.name, None, st.fs_type, st.mkfs_options,
                                  v.image.pool, v.image.name, encrypted))
        size_after = new_size if new_size is not None else (self.dev.size if self.dev else None)
        smaller = fs_size is not None and size_after is not None and (
            size_after - fs_size > GROW_SLACK)
        mount = self.staged_mount()
        want = mountflags.stage_options(st.mount_options)
        if mount is None:
            self.check_path_free(st.path, "staging")
            self.add(MountStaging(v.name, device, st.path, "filesystem", st.fs_type,
                                  want, smaller and st.fs_type == "ext4"))
            if smaller and st.fs_type == "xfs":
                self.add(GrowFilesystem(v.name, device, st.path, "xfs", fs_size,
                                        size_after or 0))
            return
        if self.fs_refuses_writes(mount, st.mount_options):
            return  # no remount (it could make it read-write again) and no grow
        self.remount_staging(mount, want)
        if smaller:
            if st.fs_type == "ext4" and img_meta.get(meta.GROW_PENDING):
                self.plan.notes.append(
                    f"ext4 on {st.path} is {format_size(fs_size or 0)}, the device "
                    f"{format_size(size_after or 0)}: online grow was refused on this node; "
                    "it grows offline at the next stage")
            else:
                self.add(GrowFilesystem(v.name, device, st.path, st.fs_type, fs_size,
                                        size_after or 0))

    def fs_refuses_writes(self, mount: Mount, options: tuple[str, ...]) -> bool:
        """The filesystem gone read-only (errors=remount-ro after an I/O error,
        a fenced client, or a remount by hand) while the spec wants it
        writable: reported, never remounted read-write (over errors that
        could make things worse; and a spec cannot ask for read-only there)."""
        if not mount.fs_read_only or "ro" in options:
            return False
        how = ("shut down" if "shutdown" in mount.super_options else
               "read-only after an error (emergency_ro)" if "emergency_ro" in mount.super_options
               else "read-only")
        self.plan.problems["FilesystemReadOnly"] = (
            f"the {mount.fs_type} filesystem on {mount.source} is {how}: every write through "
            f"{mount.mount_point} and its publishes fails. It is not remounted read-write "
            "(after I/O errors that would make things worse): see the kernel log "
            f"(dmesg | grep {mount.source.rsplit('/', 1)[-1]}) and `rbd-reconciler explain "
            f"{self.v.name}`; docs/troubleshooting.md, RbdFilesystemReadOnly")
        return True

    def remount_staging(self, mount: Mount, want: tuple[str, ...]) -> None:
        """A staging mount without what the spec (and nosuid,nodev) asks:
        remounted. A remount sets the mount's flags anew, so it says every
        option a remount can change; one it cannot (ext4 data=, most of xfs's)
        waits for the next stage, noted, never remounted for in vain."""
        st = self.v.stage
        assert st is not None
        missing = missing_options(mount, want, st.fs_type)
        later = [o for o in missing if not mountflags.remountable(o, st.fs_type)]
        if later:
            self.plan.notes.append(
                f"{st.path} is mounted without {', '.join(later)}: a remount does not change "
                "that; it takes effect the next time the volume is staged")
        if len(later) < len(missing):
            self.add(Remount(self.v.name, st.path, tuple(sorted(mount.options)),
                             tuple(o for o in want if mountflags.remountable(o, st.fs_type)),
                             bind=False))
