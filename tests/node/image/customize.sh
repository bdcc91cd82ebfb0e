#!/usr/bin/env bash
# mmdebstrap --customize-hook for the node's root filesystem ($1), run on the
# host by scripts/node-tests.sh. NODEBOX_KDIR (the extracted stock kernel
# package), NODEBOX_KVER and NODEBOX_MODULES (a file: module paths relative to
# lib/modules/KVER, one a line) come from there.
set -euo pipefail
R=$1
HERE=$(cd "$(dirname "$0")" && pwd)

echo nodebox >"$R/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 nodebox\n' >"$R/etc/hosts"
chroot "$R" passwd -d root >/dev/null            # console login for debugging a run by hand
# No network source: what apt installs in the node comes from a local file.
printf '# The node has no network access: apt install ./PACKAGE.deb only.\n' \
  >"$R/etc/apt/sources.list"
install -m 0644 "$HERE/fstab" "$R/etc/fstab"
mkdir -p "$R/mnt/run" "$R/mnt/repo" "$R/var/log/journal"  # the journal persists across boots
install -m 0644 "$HERE/10-nodebox.network" "$R/etc/systemd/network/10-nodebox.network"
install -m 0644 "$HERE/nodebox-agent.service" "$R/etc/systemd/system/nodebox-agent.service"
printf '9pnet_virtio\n9p\n' >"$R/etc/modules-load.d/nodebox-9p.conf"
chroot "$R" systemctl enable -q systemd-networkd.service nodebox-agent.service
chroot "$R" systemctl set-default -q multi-user.target
# Periodic jobs nobody waits for; under emulation they only steal time.
chroot "$R" systemctl disable -q apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer \
  e2scrub_all.timer e2scrub_reap.service fstrim.timer getty@tty1.service

# The stock kernel's modules: only the ones a node of ours loads (and what
# they need), then depmod, so modprobe and udev find them.
M=$R/lib/modules/$NODEBOX_KVER
mkdir -p "$M"
( cd "$NODEBOX_KDIR/lib/modules/$NODEBOX_KVER" && cp --parents -t "$M" modules.order modules.builtin \
    modules.builtin.modinfo $(cat "$NODEBOX_MODULES") )
depmod -b "$R" "$NODEBOX_KVER"
