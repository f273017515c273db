#!/usr/bin/env bash
# Installs control-plane .debs into a fresh Debian chroot and checks what
# dpkg does with them; the control plane's counterpart of install-test.sh
# (needs root, debootstrap and Debian's mirror, about three minutes, so not
# part of CI's quick checks). Everything happens under one directory made by
# mktemp in /var/tmp, removed at the end; nothing is mounted.
#
#   1. a minimal Debian (debootstrap --variant=minbase: no systemd, like a
#      container): leasehold-site-agent alone first (it needs no
#      leasehold-common), whose preinst creates the system user and group
#      leasehold; then leasehold-common, -api and -doctor, whose preinst
#      finds them; the files, modes and owners; the binaries run; nothing
#      fails for want of systemctl;
#   2. with systemd installed in the chroot (not running, like an image
#      build): a reinstall enables nothing; a unit the operator enabled
#      stays enabled across an upgrade (a reinstall);
#   3. edited leasehold.env and api.env survive the reinstall;
#   4. removing the api disables its unit and keeps api.env; purge deletes
#      api.env and keeps the user, leasehold-common's leasehold.env and the
#      files an operator added (tokens); removing the site agent keeps
#      /var/lib/leasehold and what is in it.
#
#   deploy/nfpm/install-test-control-plane.sh DIST PKG_VERSION [ARCH [SUITE]]
#
# DEBOOTSTRAP_CACHE names a directory to keep debootstrap's downloads in
# between runs (none by default); DEBIAN_MIRROR another mirror.
set -euo pipefail

dist=$(realpath "$1")
version=$2
arch=${3:-amd64}
suite=${4:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[ "$(id -u)" = 0 ] || {
	echo "install-test: needs root (chroot)" >&2
	exit 1
}
command -v debootstrap >/dev/null 2>&1 || {
	echo "install-test: needs debootstrap (apt-get install debootstrap)" >&2
	exit 1
}
deb() { echo "$dist/leasehold-$1_${version}_$2.deb"; }
for p in "common all" "api $arch" "doctor $arch" "site-agent $arch"; do
	# shellcheck disable=SC2086
	f=$(deb $p)
	[ -f "$f" ] || {
		echo "install-test: $f not found (make packages VERSION=… ARCH=$arch)" >&2
		exit 1
	}
done
work=$(mktemp -d /var/tmp/leasehold-cp-chroot.XXXXXX)
root=$work/root
trap 'rm -rf --one-file-system "$work"' EXIT
fail() {
	echo "install-test: $*" >&2
	exit 1
}
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive "$@"; }
mode() { in_root stat -c '%a %U:%G' "$1"; } # names from the chroot's passwd
want_mode() { # want_mode PATH "MODE USER:GROUP"
	[ "$(mode "$1")" = "$2" ] || fail "$1 is $(mode "$1"), not $2"
}

cache=()
if [ -n "${DEBOOTSTRAP_CACHE:-}" ]; then
	mkdir -p "$DEBOOTSTRAP_CACHE"
	cache=(--cache-dir="$DEBOOTSTRAP_CACHE")
fi
start=$SECONDS
echo "== debootstrap $suite (minbase, $arch) into $root"
debootstrap --variant=minbase --arch="$arch" "${cache[@]}" "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
	tail -20 "$work/debootstrap.log" >&2
	fail "debootstrap failed"
}
mkdir -p "$root/tmp/pkgs"
cp "$(deb common all)" "$root/tmp/pkgs/common.deb"
for s in api doctor site-agent; do cp "$(deb "$s" "$arch")" "$root/tmp/pkgs/$s.deb"; done

echo "== 1. install without systemd"
in_root test ! -e /usr/bin/systemctl || fail "minbase has systemctl"
! in_root getent passwd leasehold >/dev/null || fail "minbase already has a user leasehold"
in_root dpkg -i /tmp/pkgs/site-agent.deb
entry=$(in_root getent passwd leasehold) || fail "the site agent's preinst did not create the user leasehold"
echo "user: $entry"
IFS=: read -r _ _ uid gid _ home shell <<<"$entry"
[ "$uid" -lt 1000 ] || fail "leasehold is not a system user (uid $uid)"
[ "$(in_root getent group leasehold | cut -d: -f3)" = "$gid" ] || fail "leasehold's primary group is not leasehold"
[ "$home" = /var/lib/leasehold ] || fail "leasehold's home is $home"
case $shell in */nologin | /bin/false) ;; *) fail "leasehold's shell is $shell" ;; esac
want_mode /var/lib/leasehold "750 leasehold:leasehold"
want_mode /var/lib/leasehold/tftp "750 leasehold:leasehold"
want_mode /etc/leasehold/tls "750 root:leasehold"
want_mode /etc/leasehold/site-agent.env "600 root:root"
in_root dpkg -i /tmp/pkgs/common.deb /tmp/pkgs/api.deb /tmp/pkgs/doctor.deb
[ "$(in_root getent passwd leasehold)" = "$entry" ] || fail "the user leasehold changed when the other packages came"
for p in common api doctor site-agent; do
	in_root dpkg -s "leasehold-$p" | grep -qx 'Status: install ok installed' || fail "leasehold-$p is not installed"
done
want_mode /etc/leasehold/leasehold.env "600 root:root"
want_mode /etc/leasehold/api.env "600 root:root"
want_mode /usr/bin/leasehold-api "755 root:root"
for u in leasehold-api.service leasehold-doctor.service leasehold-doctor-check.service leasehold-doctor-check.timer leasehold-site-agent.service; do
	[ -f "$root/lib/systemd/system/$u" ] || fail "no $u"
done
for b in api doctor site-agent; do in_root "/usr/bin/leasehold-$b" --version; done

echo "== 2. systemd present, not running: nothing enabled"
cp /etc/resolv.conf "$root/etc/resolv.conf"
in_root apt-get update -q >/dev/null
in_root apt-get install -y -q --no-install-recommends systemd >/dev/null
in_root dpkg -i /tmp/pkgs/common.deb /tmp/pkgs/api.deb /tmp/pkgs/doctor.deb /tmp/pkgs/site-agent.deb
wants=$(find "$root/etc/systemd/system" -name 'leasehold-*' 2>/dev/null || true)
[ -z "$wants" ] || fail "the packages enabled units: $wants"
in_root systemctl is-enabled leasehold-api.service >"$work/state" 2>&1 || true
grep -qx disabled "$work/state" || fail "leasehold-api.service is $(cat "$work/state"), not disabled"
# The operator's: enabled offline (only symlinks), kept by an upgrade.
in_root systemctl enable leasehold-api.service leasehold-doctor-check.timer
in_root dpkg -i /tmp/pkgs/api.deb /tmp/pkgs/doctor.deb
in_root systemctl is-enabled leasehold-api.service leasehold-doctor-check.timer >/dev/null || fail "an upgrade disabled the operator's units"
in_root systemd-analyze verify leasehold-api.service leasehold-doctor-check.timer leasehold-site-agent.service >"$work/verify" 2>&1 || {
	cat "$work/verify" >&2
	fail "systemd-analyze verify in the chroot failed"
}

echo "== 3. edited env files survive a reinstall"
echo 'LEASEHOLD_DATABASE_URL=postgres://leasehold@db.example.net/leasehold' >>"$root/etc/leasehold/leasehold.env"
echo 'LEASEHOLD_MIGRATE=true' >>"$root/etc/leasehold/api.env"
in_root dpkg -i /tmp/pkgs/common.deb /tmp/pkgs/api.deb
grep -qx 'LEASEHOLD_DATABASE_URL=postgres://leasehold@db.example.net/leasehold' "$root/etc/leasehold/leasehold.env" || fail "leasehold.env was overwritten"
grep -qx 'LEASEHOLD_MIGRATE=true' "$root/etc/leasehold/api.env" || fail "api.env was overwritten"

echo "== 4. remove, then purge"
install -m 0640 -g "$gid" /dev/null "$root/etc/leasehold/api-tokens"
echo 'cached image' >"$root/var/lib/leasehold/tftp/undionly.kpxe"
in_root dpkg -r leasehold-api
[ ! -e "$root/usr/bin/leasehold-api" ] || fail "the binary is left after remove"
[ -z "$(find "$root/etc/systemd/system" -name 'leasehold-api.service')" ] || fail "leasehold-api is still enabled after remove"
[ -f "$root/etc/leasehold/api.env" ] || fail "remove took api.env (a conffile)"
in_root dpkg -P leasehold-api
[ ! -e "$root/etc/leasehold/api.env" ] || fail "purge left api.env"
[ -f "$root/etc/leasehold/api-tokens" ] || fail "purge took the operator's api-tokens"
[ -f "$root/etc/leasehold/leasehold.env" ] || fail "purging the api took leasehold-common's leasehold.env"
in_root dpkg -P leasehold-doctor leasehold-site-agent
[ -f "$root/var/lib/leasehold/tftp/undionly.kpxe" ] || fail "purging the site agent took /var/lib/leasehold"
in_root dpkg -P leasehold-common
[ ! -e "$root/etc/leasehold/leasehold.env" ] || fail "purge left leasehold.env"
in_root getent passwd leasehold >/dev/null || fail "purge deleted the user leasehold"
echo "control-plane install test ok ($((SECONDS - start)) s)"
