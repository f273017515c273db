#!/usr/bin/env bash
# Checks the control-plane packages that `make packages` built (run by
# `make check-packages`, after deploy/nfpm/check.sh has checked the node's):
#
#   deploy/nfpm/check-control-plane.sh DIST PKG_VERSION ARCH
#
# reads DIST/leasehold-{api,gateway,worker,scheduler,doctor,site-agent}_PKG_VERSION_ARCH.{deb,rpm}
# and DIST/leasehold-common_PKG_VERSION_all.{deb,rpm}, and checks for each:
#
#   - the .deb's control data: name, architecture, Depends (leasehold-common,
#     but for the site agent), Pre-Depends (passwd), the maintainer scripts,
#     and its conffiles, exactly;
#   - its files, exactly, with their modes and owners (dpkg-deb --contents):
#     the binary, the units, the env file 0600 root, the directories given
#     to the user leasehold;
#   - the binary is static, built for ARCH with cgo off, from its service;
#   - the units: ExecStart=/usr/bin/leasehold-<service>, User= and Group=
#     leasehold, every EnvironmentFile= they need shipped by the package or
#     by leasehold-common, and systemd-analyze verify, when it exists;
#   - the maintainer scripts, with stubs of systemctl and of the user tools
#     (the real ones are out of PATH: nothing is created on this machine),
#     for dpkg's arguments and rpm's: preinst creates the group and the user
#     once (useradd, or Debian's adduser) and fails without either tool;
#     postinst only reloads systemd, never enables, starts or restarts;
#     prerm disables and stops the package's units on removal only; postrm
#     reloads; none fails without systemctl. "systemd running" is a tmpfs on
#     /run in a mount namespace (unshare), when the machine allows one;
#   - the .rpm (when rpm exists): architecture, files with modes and owners,
#     config files, scriptlets, Requires; and all of them (the node's too)
#     install together into an empty rpm database (--test: no file conflict);
#   - across the .debs, the node's included: no file in two packages (dpkg
#     would refuse the second), and a directory that several ship has the
#     same mode and owner in each.
set -euo pipefail
# shellcheck source=deploy/nfpm/checklib.sh
. "$(dirname "$0")/checklib.sh"

dist=$1 version=$2 arch=$3
rpm_arch=$(rpm_arch_of "$arch")
services=(api gateway worker scheduler doctor site-agent)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
units_of() {
	case $1 in
	doctor) echo leasehold-doctor.service leasehold-doctor-check.service leasehold-doctor-check.timer ;;
	*) echo "leasehold-$1.service" ;;
	esac
}
deb_of() { if [ "$1" = common ]; then echo "$dist/leasehold-common_${version}_all.deb"; else echo "$dist/leasehold-$1_${version}_$arch.deb"; fi; }
rpm_of() { if [ "$1" = common ]; then echo "$dist/leasehold-common_${version}_all.rpm"; else echo "$dist/leasehold-$1_${version}_$arch.rpm"; fi; }

# expected PKG: "mode owner/group path" of every entry of the package,
# parent directories included (root's, 0755, unless listed).
expected() {
	local p=$1 u
	{
		case $p in
		common)
			echo "drwxr-x--- root/leasehold ./etc/leasehold/tls/"
			echo "-rw------- root/root ./etc/leasehold/leasehold.env"
			;;
		*)
			echo "-rwxr-xr-x root/root ./usr/bin/leasehold-$p"
			for u in $(units_of "$p"); do echo "-rw-r--r-- root/root ./lib/systemd/system/$u"; done
			echo "-rw------- root/root ./etc/leasehold/$p.env"
			;;
		esac
		if [ "$p" = site-agent ]; then
			echo "drwxr-x--- root/leasehold ./etc/leasehold/tls/"
			echo "drwxr-x--- leasehold/leasehold ./var/lib/leasehold/"
			echo "drwxr-x--- leasehold/leasehold ./var/lib/leasehold/tftp/"
		fi
	} >"$work/listed"
	# Parent directories not listed: drwxr-xr-x root/root.
	awk '{ print $3 }' "$work/listed" | while read -r path; do
		path=${path%/}
		while path=${path%/*}; [ "$path" != . ]; do echo "$path/"; done
	done | sort -u | while read -r dir; do
		grep -q " $dir\$" "$work/listed" || echo "drwxr-xr-x root/root $dir"
	done >>"$work/listed"
	sort -k3 "$work/listed"
}

# The stubs: systemctl and the user tools log their arguments; getent
# answers from STUB_EXISTING ("passwd group": the user and group exist).
stub=$work/stub
mkdir -p "$stub/all" "$stub/adduser" "$stub/none"
cat >"$stub/all/systemctl" <<'STUB'
#!/bin/sh
echo "systemctl $*" >>"$STUB_LOG"
case "$1" in is-active | is-enabled) exit 0 ;; esac
STUB
cat >"$stub/all/getent" <<'STUB'
#!/bin/sh
case " ${STUB_EXISTING:-} " in *" $1 "*) echo "$2:x:999:" ; exit 0 ;; esac
exit 2
STUB
for t in useradd groupadd adduser addgroup usermod groupmod; do
	printf '#!/bin/sh\necho "%s $*" >>"$STUB_LOG"\n' "$t" >"$stub/all/$t"
done
chmod +x "$stub/all/"*
# adduser/: Debian's adduser and addgroup, no useradd; none/: neither.
for t in systemctl getent adduser addgroup; do ln -s "$stub/all/$t" "$stub/adduser/$t"; done
for t in systemctl getent; do ln -s "$stub/all/$t" "$stub/none/$t"; done
# The login shell preinst gives the user: this machine's nologin.
nologin=/bin/false
for f in /usr/sbin/nologin /sbin/nologin; do
	if [ -x "$f" ]; then
		nologin=$f
		break
	fi
done
# Only /usr/bin and /bin besides a stub directory: useradd, groupadd and
# adduser live in /usr/sbin, out of reach.
base_path=/usr/bin:/bin

# systemd "running": /run/systemd/system exists, on a tmpfs over /run in a
# private mount namespace (root, or an unprivileged user namespace).
running=""
for u in "unshare -m" "unshare -rm"; do
	if $u sh -c 'mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/system' 2>/dev/null; then
		running=$u
		break
	fi
done
[ -n "$running" ] || echo "(no mount namespace here: the scripts are run without a running systemd only)"

# run WHAT STUBDIR SYSTEMD SCRIPT ARGS...: runs the script with the stubs,
# systemd running (SYSTEMD=yes) or not; $work/calls gets what it called,
# $work/out its output, $work/rc its exit status.
run() {
	local what=$1 dir=$2 sd=$3 script=$4
	shift 4
	: >"$work/calls"
	local rc=0
	local cmd=(env -i PATH="$stub/$dir:$base_path" STUB_LOG="$work/calls" STUB_EXISTING="${STUB_EXISTING:-}" sh "$script" "$@")
	if [ "$sd" = yes ]; then
		$running sh -c 'mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/system && exec "$@"' sh "${cmd[@]}" >"$work/out" 2>&1 || rc=$?
	else
		"${cmd[@]}" >"$work/out" 2>&1 || rc=$?
	fi
	echo $rc >"$work/rc"
	if grep -Eq '^systemctl .*(\b(start|restart|try-restart|reload-or-restart|try-reload-or-restart|enable|reenable|preset|unmask)\b|--now)' "$work/calls"; then
		cat "$work/calls" >&2
		fail "$what: enables, starts or restarts a service"
	fi
}
ok() { # ok WHAT: exited 0
	[ "$(cat "$work/rc")" = 0 ] || {
		cat "$work/out" >&2
		fail "$1: exited $(cat "$work/rc")"
	}
}
calls() { # calls WHAT LINE...: exactly these calls, in this order
	local what=$1
	shift
	if [ $# -gt 0 ]; then printf '%s\n' "$@" >"$work/want"; else : >"$work/want"; fi
	same "$work/want" "$work/calls" "$what: not the expected calls"
}
yes_if_running() { if [ -n "$running" ]; then echo yes; else echo no; fi; }

check_preinst() { # check_preinst NAME SCRIPT
	local n=$1 s=$2 useradd_args
	useradd_args="--system --gid leasehold --home-dir /var/lib/leasehold --no-create-home --shell $nologin --comment leasehold control plane leasehold"
	for args in install 1; do
		STUB_EXISTING="" run "$n preinst $args" all no "$s" $args
		ok "$n preinst $args"
		calls "$n preinst $args (no user yet)" "groupadd --system leasehold" "useradd $useradd_args"
		STUB_EXISTING="passwd group" run "$n preinst $args" all no "$s" $args
		ok "$n preinst $args"
		calls "$n preinst $args (the user exists)"
	done
	STUB_EXISTING="passwd group" run "$n preinst upgrade" all no "$s" upgrade 0.0.1
	ok "$n preinst upgrade"
	calls "$n preinst upgrade (the user exists)"
	STUB_EXISTING="" run "$n preinst with adduser only" adduser no "$s" install
	ok "$n preinst with adduser only"
	calls "$n preinst with adduser only" "addgroup --system leasehold" \
		"adduser --system --ingroup leasehold --home /var/lib/leasehold --no-create-home --shell $nologin --gecos leasehold control plane --disabled-password leasehold"
	STUB_EXISTING="group" run "$n preinst, group there, no user" all no "$s" 2
	ok "$n preinst, group there, no user"
	calls "$n preinst, group there, no user" "useradd $useradd_args"
	STUB_EXISTING="" run "$n preinst without user tools" none no "$s" install
	[ "$(cat "$work/rc")" != 0 ] || fail "$n preinst succeeds without useradd or adduser (the files it gives to leasehold would get no owner)"
	has "$work/out" 'neither useradd nor adduser' "$n preinst without user tools does not say why it fails"
	echo "$n preinst: creates group and user once (useradd or adduser), fails without either: ok"
}

check_scripts() { # check_scripts SERVICE DIR: the four scripts extracted in DIR
	local s=$1 d=$2 sd
	local units
	units=$(units_of "$s")
	sd=$(yes_if_running)
	local reload=()
	[ "$sd" = yes ] && reload=("systemctl daemon-reload")
	check_preinst "leasehold-$s" "$d/preinst"
	for args in "configure|" "configure|0.0.1" "1|" "2|" "abort-upgrade|0.0.1"; do
		run "leasehold-$s postinst ${args/|/ }" all "$sd" "$d/postinst" "${args%%|*}" "${args#*|}"
		ok "leasehold-$s postinst ${args/|/ }"
		calls "leasehold-$s postinst ${args/|/ }" "${reload[@]}"
	done
	run "leasehold-$s postinst configure" all no "$d/postinst" configure ""
	calls "leasehold-$s postinst configure, systemd not running"
	has "$work/out" 'systemctl enable --now leasehold-<service>' "leasehold-$s postinst does not say how to start the service"
	for args in upgrade 1 failed-upgrade deconfigure; do
		run "leasehold-$s prerm $args" all "$sd" "$d/prerm" $args 9.9.9
		ok "leasehold-$s prerm $args"
		calls "leasehold-$s prerm $args"
	done
	for args in remove 0; do
		run "leasehold-$s prerm $args" all "$sd" "$d/prerm" $args
		ok "leasehold-$s prerm $args"
		if [ "$sd" = yes ]; then
			calls "leasehold-$s prerm $args" "systemctl disable $units" "systemctl stop $units"
		else
			calls "leasehold-$s prerm $args" "systemctl disable $units"
		fi
		run "leasehold-$s prerm $args" all no "$d/prerm" $args
		ok "leasehold-$s prerm $args"
		calls "leasehold-$s prerm $args, systemd not running" "systemctl disable $units"
	done
	for args in remove purge upgrade 0 1; do
		run "leasehold-$s postrm $args" all "$sd" "$d/postrm" $args
		ok "leasehold-$s postrm $args"
		calls "leasehold-$s postrm $args" "${reload[@]}"
	done
	# No systemctl at all (a minimal container): still exit 0.
	mkdir -p "$work/empty"
	for sc in "postinst configure" "postinst 1" "prerm remove" "prerm 0" "postrm purge"; do
		env -i PATH="$work/empty:$base_path" sh "$d/${sc%% *}" ${sc#* } >/dev/null 2>&1 ||
			fail "leasehold-$s ${sc}: fails without systemctl"
	done
	echo "leasehold-$s scripts: postinst only reloads ($([ "$sd" = yes ] && echo "systemd running and not" || echo "systemd not running")), prerm disables and stops $units on removal only, none fails without systemctl: ok"
}

check_unit_files() { # check_unit_files SERVICE ROOT: the units of the extracted package
	local s=$1 root=$2 u f bin=$2/usr/bin/leasehold-$1
	mkdir -p "$work/units-$s"
	for u in $(units_of "$s"); do
		f=$root/lib/systemd/system/$u
		case $u in
		*.service)
			grep -Eq "^ExecStart=/usr/bin/leasehold-$s( |\$)" "$f" || fail "$u: ExecStart is not /usr/bin/leasehold-$s"
			grep -qx 'User=leasehold' "$f" || fail "$u: not User=leasehold"
			grep -qx 'Group=leasehold' "$f" || fail "$u: not Group=leasehold"
			# A required EnvironmentFile= (no leading -) must be shipped:
			# by this package, or by leasehold-common when it depends on it.
			sed -n 's/^EnvironmentFile=\([^-].*\)$/\1/p' "$f" | while read -r env; do
				if [ -e "$root$env" ]; then continue; fi
				if [ "$s" != site-agent ] && [ -e "$work/root-common$env" ]; then continue; fi
				fail "$u: EnvironmentFile=$env is shipped by no package it depends on"
			done
			;;
		esac
		# Verified with ExecStart pointing at the extracted binary (verify
		# checks that it is executable).
		sed "s|^ExecStart=/usr/bin/leasehold-$s|ExecStart=$bin|" "$f" >"$work/units-$s/$u"
	done
	grep -q '^AmbientCapabilities=' "$root"/lib/systemd/system/*.service && [ "$s" != site-agent ] &&
		fail "leasehold-$s: a unit has AmbientCapabilities= (only the site agent binds privileged ports)"
	if command -v systemd-analyze >/dev/null 2>&1; then
		(cd "$work/units-$s" && systemd-analyze verify $(units_of "$s")) >"$work/verify" 2>&1 || {
			cat "$work/verify" >&2
			fail "leasehold-$s: systemd-analyze verify failed"
		}
		if grep -q . "$work/verify"; then
			cat "$work/verify" >&2
			fail "leasehold-$s: systemd-analyze verify warned"
		fi
		echo "leasehold-$s units: systemd-analyze verify $(units_of "$s"): ok"
	fi
}

check_deb() { # check_deb PKG (a service, or common)
	local p=$1 deb name=leasehold-$1
	deb=$(deb_of "$p")
	[ -f "$deb" ] || fail "$deb not found (make packages)"
	echo "== $(basename "$deb")"
	dpkg-deb --info "$deb" >"$work/info"
	has "$work/info" "^ Package: $name\$" "$deb: package name is not $name"
	has "$work/info" "^ Version: $(sed 's/[.+~]/\\&/g' <<<"$version")-1\$" "$deb: version is not $version-1"
	if [ "$p" = common ]; then
		has "$work/info" '^ Architecture: all$' "$deb: architecture is not all"
	else
		has "$work/info" "^ Architecture: $arch\$" "$deb: architecture is not $arch"
	fi
	has "$work/info" '^ Pre-Depends: passwd$' "$deb: no Pre-Depends: passwd (preinst runs useradd)"
	case $p in
	common | site-agent)
		if grep -q '^ Depends:' "$work/info"; then
			cat "$work/info" >&2
			fail "$deb: depends on something"
		fi
		;;
	*) has "$work/info" "^ Depends: leasehold-common \\(>= $(sed 's/[.+~]/\\&/g' <<<"$version")\\)\$" "$deb: does not depend on leasehold-common (>= $version)" ;;
	esac
	has "$work/info" '^ Description: leasehold ' "$deb: no description"
	local scripts=(preinst) conffile=/etc/leasehold/$p.env
	[ "$p" = common ] && conffile=/etc/leasehold/leasehold.env
	[ "$p" = common ] || scripts+=(postinst prerm postrm)
	for s in "${scripts[@]}" conffiles; do
		has "$work/info" "^ +[0-9]+ bytes, +[0-9]+ lines +\\*? *$s( |\$)" "$deb: no $s in the control archive"
	done
	if [ "$p" = common ]; then
		for s in postinst prerm postrm; do
			! grep -Eq "^ +[0-9]+ bytes, +[0-9]+ lines +\\*? *$s( |\$)" "$work/info" || fail "$deb: has a $s"
		done
	else
		has "$work/info" 'systemctl enable --now' "$deb: the description does not say how to start it"
		has "$work/info" 'enables and starts nothing' "$deb: the description does not say that installing starts nothing"
	fi
	dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles >"$work/conffiles"
	echo "$conffile" >"$work/want"
	same "$work/want" "$work/conffiles" "$deb: conffiles"

	dpkg-deb --contents "$deb" | awk '{ print $1, $2, $6 }' | sort -k3 >"$work/contents-$p"
	expected "$p" >"$work/want"
	same "$work/want" "$work/contents-$p" "$deb: files, modes or owners"
	echo "files: $(grep -vc '^d' "$work/contents-$p"), conffile $conffile, scripts ${scripts[*]}: ok"

	local root=$work/root-$p
	dpkg-deb -x "$deb" "$root"
	mkdir -p "$work/scripts-$p"
	dpkg-deb --ctrl-tarfile "$deb" | tar -x -C "$work/scripts-$p" $(printf './%s ' "${scripts[@]}")
	if [ "$p" = common ]; then
		check_preinst "$name" "$work/scripts-$p/preinst"
		return
	fi

	local bin=$root/usr/bin/$name
	file "$bin" >"$work/file"
	has "$work/file" 'statically linked' "$name: the binary is not static"
	go version -m "$bin" >"$work/buildinfo"
	has "$work/buildinfo" '^[[:space:]]+build[[:space:]]+CGO_ENABLED=0$' "$name: built with cgo"
	has "$work/buildinfo" "^[[:space:]]+build[[:space:]]+GOARCH=$arch\$" "$name: not built for $arch"
	has "$work/buildinfo" "^[[:space:]]+path[[:space:]]+github.com/leasehold/leasehold/services/$p\$" "$name: not built from services/$p"
	echo "$name: static, $arch, cgo off: ok"
	check_unit_files "$p" "$root"
	check_scripts "$p" "$work/scripts-$p"
}

check_rpm() { # check_rpm PKG
	local p=$1 rpm want_arch=$rpm_arch
	rpm=$(rpm_of "$p")
	[ -f "$rpm" ] || fail "$rpm not found (make packages)"
	[ "$p" = common ] && want_arch=noarch
	echo "== $(basename "$rpm")"
	rpm -qpi "$rpm" >"$work/rpminfo" 2>&1
	has "$work/rpminfo" "^Name +: leasehold-$p\$" "$rpm: name is not leasehold-$p"
	has "$work/rpminfo" "^Architecture: $want_arch\$" "$rpm: architecture is not $want_arch"
	# Files with modes and owners: the deb's, without the parent
	# directories that other packages own (/usr/bin, /lib/systemd/system).
	rpm -qp --qf '[%{FILEMODES:perms} %{FILEUSERNAME}/%{FILEGROUPNAME} .%{FILENAMES}\n]' "$rpm" |
		awk '{ if ($1 ~ /^d/) $3 = $3 "/"; print }' | sort -k3 >"$work/rpmfiles"
	awk 'NR == FNR { have[$3]; next } ($3 in have)' "$work/rpmfiles" "$work/contents-$p" >"$work/want"
	same "$work/want" "$work/rpmfiles" "$rpm: files, modes or owners differ from the .deb's"
	grep -vq '^d' "$work/rpmfiles" || fail "$rpm: no file"
	# Every file and explicitly typed directory of the .deb is in the .rpm.
	expected "$p" | grep -v '^drwxr-xr-x root/root' | grep -vxF -f "$work/rpmfiles" >"$work/missing" || true
	if [ -s "$work/missing" ]; then
		cat "$work/missing" >&2
		fail "$rpm: lacks these entries of the .deb"
	fi
	rpm -qpc "$rpm" >"$work/rpmconf"
	if [ "$p" = common ]; then echo /etc/leasehold/leasehold.env; else echo "/etc/leasehold/$p.env"; fi >"$work/want"
	same "$work/want" "$work/rpmconf" "$rpm: config files"
	rpm -qp --scripts "$rpm" >"$work/rpmscripts"
	local scriptlets=(preinstall)
	[ "$p" = common ] || scriptlets+=(postinstall preuninstall postuninstall)
	for s in "${scriptlets[@]}"; do
		has "$work/rpmscripts" "^$s scriptlet" "$rpm: no $s scriptlet"
	done
	rpm -qpR "$rpm" >"$work/requires"
	case $p in
	common | site-agent) ! grep -q '^leasehold-common' "$work/requires" || fail "$rpm: requires leasehold-common" ;;
	*) has "$work/requires" "^leasehold-common >= $(sed 's/[.+~]/\\&/g' <<<"$version")\$" "$rpm: does not require leasehold-common >= $version" ;;
	esac
	echo "rpm: $want_arch, $(grep -vc '^d' "$work/rpmfiles") files, config $(paste -sd, "$work/rpmconf"), scriptlets ${scriptlets[*]}: ok"
}

start=$SECONDS
for p in common "${services[@]}"; do
	check_deb "$p"
done

echo "== across the .debs (leasehold-node's included)"
node_deb=$dist/leasehold-node_${version}_$arch.deb
[ -f "$node_deb" ] || fail "$node_deb not found (make packages)"
dpkg-deb --contents "$node_deb" | awk '{ print $1, $2, $6 }' >"$work/contents-node"
cat "$work"/contents-* | grep -v '^d' | awk '{ print $3 }' | sort | uniq -d >"$work/dup"
[ ! -s "$work/dup" ] || {
	cat "$work/dup" >&2
	fail "a file in two packages (dpkg refuses the second)"
}
cat "$work"/contents-* | grep '^d' | sort -u | awk '{ print $3 }' | sort | uniq -d >"$work/dup"
[ ! -s "$work/dup" ] || {
	grep -h -F -f "$work/dup" "$work"/contents-* | sort -u >&2
	fail "a directory with different modes or owners in two packages"
}
echo "no file in two packages, shared directories alike: ok"

if command -v rpm >/dev/null 2>&1; then
	for p in common "${services[@]}"; do
		check_rpm "$p"
	done
	echo "== the .rpms install together (rpm --test into an empty database)"
	mkdir -p "$work/rpmroot/etc"
	printf 'root:x:0:0:root:/root:/bin/sh\nleasehold:x:999:999::/var/lib/leasehold:/sbin/nologin\n' >"$work/rpmroot/etc/passwd"
	printf 'root:x:0:\nleasehold:x:999:\n' >"$work/rpmroot/etc/group"
	rpm --root "$work/rpmroot" --initdb
	pkgs=("$dist/leasehold-node_${version}_$arch.rpm")
	for p in common "${services[@]}"; do pkgs+=("$(rpm_of "$p")"); done
	rpm --root "$work/rpmroot" -i --test --nodeps --ignorearch --ignoreos "${pkgs[@]}" >"$work/rpmtest" 2>&1 || {
		cat "$work/rpmtest" >&2
		fail "the .rpms do not install together"
	}
	# Debian's rpm says it prefers alien; any other line is a warning.
	if grep -Ev '^rpm: (RPM should not be used directly|However assuming you know)' "$work/rpmtest" | grep -q .; then
		cat "$work/rpmtest" >&2
		fail "rpm -i --test warned"
	fi
	echo "${#pkgs[@]} packages, no conflict: ok"
else
	echo "rpm not found (apt-get install rpm): the .rpms not checked"
fi
echo "control-plane packages ok ($((SECONDS - start)) s)"
