#!/usr/bin/env bash
# Installs the leasehold-node .deb into a fresh Debian chroot and checks
# what dpkg does with it (run by `make check-packages-install`; needs root,
# debootstrap and Debian's mirror, about two to three minutes, so not part
# of CI's quick checks):
#
#   1. a minimal Debian (debootstrap --variant=minbase: no systemd, like a
#      container): the package installs, the files are in place, the
#      static binary runs, nothing fails for want of systemctl;
#   2. with systemd installed in the chroot (not running, like an image
#      build): a first install enables the unit offline, and starts nothing;
#   3. an edited /etc/leasehold/node.env survives a reinstall;
#   4. remove disables the unit and keeps node.env and the state
#      directory; purge removes node.env and still keeps the state.
#
#   deploy/nfpm/install-test.sh DEB [SUITE]
set -euo pipefail

deb=$(realpath "$1")
suite=${2:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=${DEBOOTSTRAP_CACHE:-$HOME/.cache/leasehold/debootstrap}
[ "$(id -u)" = 0 ] || {
	echo "install-test: needs root (chroot)" >&2
	exit 1
}
command -v debootstrap >/dev/null 2>&1 || {
	echo "install-test: needs debootstrap (apt-get install debootstrap)" >&2
	exit 1
}
root=$(mktemp -d /var/tmp/leasehold-chroot.XXXXXX)
trap 'rm -rf --one-file-system "$root"' EXIT
fail() {
	echo "install-test: $*" >&2
	exit 1
}
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive "$@"; }

mkdir -p "$cache"
echo "== debootstrap $suite (minbase) into $root"
debootstrap --variant=minbase --cache-dir="$cache" "$suite" "$root" "$mirror" >"$root.log" 2>&1 || {
	tail -20 "$root.log" >&2
	rm -f "$root.log"
	fail "debootstrap failed"
}
rm -f "$root.log"
cp "$deb" "$root/tmp/leasehold-node.deb"

echo "== 1. install without systemd"
in_root test ! -e /usr/bin/systemctl || fail "minbase has systemctl"
in_root dpkg -i /tmp/leasehold-node.deb
in_root dpkg -s leasehold-node | grep -qx 'Status: install ok installed' || fail "not installed"
[ "$(stat -c %a "$root/etc/leasehold/node.env")" = 600 ] || fail "node.env is not 0600"
[ -f "$root/lib/systemd/system/leasehold-node.service" ] || fail "no unit"
in_root /usr/bin/leasehold-node --version
[ ! -e "$root/var/lib/leasehold-node" ] || fail "the package created the state directory (systemd's StateDirectory= does)"

echo "== 2. first install with systemd present, not running"
cp /etc/resolv.conf "$root/etc/resolv.conf"
in_root dpkg -P leasehold-node
in_root apt-get update -q >/dev/null
in_root apt-get install -y -q --no-install-recommends systemd >/dev/null
in_root dpkg -i /tmp/leasehold-node.deb
[ -L "$root/etc/systemd/system/multi-user.target.wants/leasehold-node.service" ] || fail "the unit is not enabled"
in_root systemctl is-enabled leasehold-node.service

echo "== 3. an edited node.env survives a reinstall"
echo 'LEASEHOLD_GATEWAY_URL=https://gw.example.net' >>"$root/etc/leasehold/node.env"
in_root dpkg -i /tmp/leasehold-node.deb
grep -qx 'LEASEHOLD_GATEWAY_URL=https://gw.example.net' "$root/etc/leasehold/node.env" || fail "node.env was overwritten"

echo "== 4. remove, then purge"
mkdir -p -m 0700 "$root/var/lib/leasehold-node"
echo secret >"$root/var/lib/leasehold-node/credential"
in_root dpkg -r leasehold-node
[ ! -e "$root/usr/bin/leasehold-node" ] || fail "the binary is left after remove"
[ ! -e "$root/etc/systemd/system/multi-user.target.wants/leasehold-node.service" ] || fail "still enabled after remove"
[ -f "$root/etc/leasehold/node.env" ] || fail "remove took node.env (a conffile)"
in_root dpkg -P leasehold-node
[ ! -e "$root/etc/leasehold/node.env" ] || fail "purge left node.env"
[ -f "$root/var/lib/leasehold-node/credential" ] || fail "purge took the state directory"
echo "install test ok"
