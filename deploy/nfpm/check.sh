#!/usr/bin/env bash
# Checks the leasehold-node packages that `make packages` built (run by
# `make check-packages`): deploy/nfpm/check.sh DEB RPM ARCH
#
#   - the .deb's control data (dpkg-deb --info): name, architecture,
#     conffile, maintainer scripts;
#   - its files (dpkg-deb --contents): binary, unit, node.env with their
#     modes and owners;
#   - the binary is static (file) and built for ARCH with cgo off
#     (go version -m);
#   - node.env names every LEASEHOLD_* variable the binary reads (from its
#     flags, -help);
#   - the unit passes systemd-analyze verify, when systemd-analyze exists;
#   - the maintainer scripts never start the agent and never fail, with a
#     stub systemctl, on a first install, an upgrade and a removal, for
#     dpkg's arguments and rpm's;
#   - the .rpm's files, config files and scripts (rpm -qp), when rpm exists.
set -euo pipefail
# shellcheck source=deploy/nfpm/checklib.sh
. "$(dirname "$0")/checklib.sh"

deb=$1 rpm=$2 arch=$3
rpm_arch=$(rpm_arch_of "$arch")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== $deb: dpkg-deb --info"
dpkg-deb --info "$deb" | tee "$work/info"
has "$work/info" '^ Package: leasehold-node$' "package name is not leasehold-node"
has "$work/info" "^ Architecture: $arch\$" "architecture is not $arch"
for s in postinst prerm postrm conffiles; do
	has "$work/info" "^ +[0-9]+ bytes, +[0-9]+ lines +\*? *$s( |\$)" "no $s in the control archive"
done
dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles >"$work/conffiles"
has "$work/conffiles" '^/etc/leasehold/node.env$' "node.env is not a conffile"

echo "== $deb: dpkg-deb --contents"
dpkg-deb --contents "$deb" | tee "$work/contents"
has "$work/contents" '^-rwxr-xr-x root/root .* \./usr/bin/leasehold-node$' "no /usr/bin/leasehold-node 0755 root"
has "$work/contents" '^-rw-r--r-- root/root .* \./lib/systemd/system/leasehold-node\.service$' "no unit in /lib/systemd/system"
has "$work/contents" '^-rw------- root/root .* \./etc/leasehold/node\.env$' "no /etc/leasehold/node.env 0600 root"

echo "== the binary is static, for $arch, without cgo"
dpkg-deb -x "$deb" "$work/root"
bin=$work/root/usr/bin/leasehold-node
file "$bin" | tee "$work/file"
has "$work/file" 'statically linked' "the binary is not static"
go version -m "$bin" | tee "$work/buildinfo"
has "$work/buildinfo" '^[[:space:]]+build[[:space:]]+CGO_ENABLED=0$' "built with cgo"
has "$work/buildinfo" "^[[:space:]]+build[[:space:]]+GOARCH=$arch\$" "not built for $arch"
has "$work/buildinfo" '^[[:space:]]+path[[:space:]]+github.com/leasehold/leasehold/services/node$' "not leasehold-node"

echo "== node.env names every LEASEHOLD_* variable of the binary's flags"
"$bin" -help >"$work/help" 2>&1 || true
sed -n 's/^  -\([a-z][a-z0-9.-]*\).*/\1/p' "$work/help" | grep -vx version >"$work/flags" || true
[ -s "$work/flags" ] || fail "no flags read from $bin -help"
missing=()
while read -r flag; do
	env=LEASEHOLD_$(tr 'a-z.-' 'A-Z__' <<<"$flag")
	grep -Eq "^#?$env=" deploy/node/node.env || missing+=("$env (--$flag)")
done <"$work/flags"
[ ${#missing[@]} -eq 0 ] || fail "deploy/node/node.env lacks: ${missing[*]}"
echo "$(wc -l <"$work/flags") flags, all in node.env"

echo "== the unit"
unit=$work/root/lib/systemd/system/leasehold-node.service
grep -qx 'ExecStart=/usr/bin/leasehold-node' "$unit" || fail "ExecStart is not /usr/bin/leasehold-node"
if command -v systemd-analyze >/dev/null 2>&1; then
	# Verified with ExecStart pointing at the extracted binary (verify
	# checks that it is executable). RestartSteps and RestartMaxDelaySec
	# are systemd 254's: older versions warn and ignore them.
	sed "s|^ExecStart=/usr/bin/leasehold-node|ExecStart=$bin|" "$unit" >"$work/leasehold-node.service"
	systemd-analyze verify "$work/leasehold-node.service" >"$work/verify" 2>&1 || {
		cat "$work/verify" >&2
		fail "systemd-analyze verify failed"
	}
	if grep -Ev "Unknown key '(RestartSteps|RestartMaxDelaySec)' in section \[Service\], ignoring\.$" "$work/verify" | grep -q .; then
		cat "$work/verify" >&2
		fail "systemd-analyze verify warned"
	fi
	echo "systemd-analyze verify: ok ($(systemd-analyze --version | head -1))"
else
	echo "systemd-analyze not found (apt-get install systemd): unit not verified"
fi

echo "== maintainer scripts with a stub systemctl"
mkdir -p "$work/stub"
cat >"$work/stub/systemctl" <<'STUB'
#!/bin/sh
echo "$*" >>"$SYSTEMCTL_LOG"
case "$1" in is-active) exit 0 ;; esac
STUB
chmod +x "$work/stub/systemctl"
dpkg-deb --ctrl-tarfile "$deb" | tar -x -C "$work" ./postinst ./prerm ./postrm
run() { # run NAME SCRIPT ARGS...: the script must exit 0; prints systemctl's calls
	local name=$1 script=$2
	shift 2
	: >"$work/calls"
	local rc=0
	SYSTEMCTL_LOG=$work/calls PATH="$work/stub:$PATH" sh "$script" "$@" >"$work/out" 2>&1 || rc=$?
	if [ $rc -ne 0 ]; then
		cat "$work/out" >&2
		fail "$name: exited $rc"
	fi
	if grep -Eq '^(start|restart|reload-or-restart|enable --now)' "$work/calls"; then
		cat "$work/calls" >&2
		fail "$name started the agent"
	fi
	echo "$name: ok, systemctl $(paste -sd, "$work/calls")"
}
run "deb first install" "$work/postinst" configure ""
grep -qx 'enable leasehold-node.service' "$work/calls" || fail "deb first install does not enable the unit"
run "deb upgrade" "$work/postinst" configure 0.0.1
run "deb prerm upgrade" "$work/prerm" upgrade 9.9.9
[ ! -s "$work/calls" ] || fail "prerm upgrade touched the unit"
run "deb prerm remove" "$work/prerm" remove
grep -qx 'disable leasehold-node.service' "$work/calls" || fail "prerm remove does not disable the unit"
run "deb postrm purge" "$work/postrm" purge
run "rpm %post install" "$work/postinst" 1
grep -qx 'preset leasehold-node.service' "$work/calls" || fail "rpm install does not preset the unit"
run "rpm %preun upgrade" "$work/prerm" 1
[ ! -s "$work/calls" ] || fail "rpm %preun upgrade touched the unit"
# Without systemctl at all (a minimal container): still exit 0.
env PATH=/nonexistent /bin/sh "$work/postinst" configure "" >/dev/null || fail "postinst configure fails without systemctl"
env PATH=/nonexistent /bin/sh "$work/postinst" 1 >/dev/null || fail "postinst 1 fails without systemctl"
env PATH=/nonexistent /bin/sh "$work/prerm" remove >/dev/null || fail "prerm remove fails without systemctl"
env PATH=/nonexistent /bin/sh "$work/postrm" remove >/dev/null || fail "postrm remove fails without systemctl"
echo "without systemctl: ok"

if command -v rpm >/dev/null 2>&1; then
	echo "== $rpm: rpm -qp"
	rpm -qpi "$rpm" | tee "$work/rpminfo"
	has "$work/rpminfo" "^Architecture: $rpm_arch\$" "rpm architecture is not $rpm_arch"
	rpm -qplv "$rpm" | tee "$work/rpmlist"
	has "$work/rpmlist" '^-rwxr-xr-x .* root +root .* /usr/bin/leasehold-node$' "rpm: no /usr/bin/leasehold-node 0755 root"
	has "$work/rpmlist" '^-rw-r--r-- .* /lib/systemd/system/leasehold-node\.service$' "rpm: no unit"
	has "$work/rpmlist" '^-rw------- .* root +root .* /etc/leasehold/node\.env$' "rpm: no node.env 0600 root"
	rpm -qpc "$rpm" | tee "$work/rpmconf"
	has "$work/rpmconf" '^/etc/leasehold/node\.env$' "rpm: node.env is not a config file"
	rpm -qp --scripts "$rpm" >"$work/rpmscripts"
	for s in postinstall preuninstall postuninstall; do
		has "$work/rpmscripts" "^$s scriptlet" "rpm: no $s scriptlet"
	done
	echo "rpm: scriptlets postinstall, preuninstall, postuninstall"
else
	echo "rpm not found (apt-get install rpm): $rpm not checked"
fi
echo "packages ok"
