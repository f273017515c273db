#!/usr/bin/env bash
# Checks the CLI package that `make packages` built (run by
# `make check-packages`):
#
#   deploy/nfpm/check-cli.sh DIST PKG_VERSION ARCH
#
# reads DIST/leasehold_PKG_VERSION_ARCH.{deb,rpm} and checks:
#
#   - the .deb's control data: name leasehold, the architecture, no
#     Depends and no maintainer script (it installs a program and its
#     completions, nothing that runs);
#   - its files, exactly, with their modes and owners;
#   - the binary is static, built for ARCH with cgo off, from services/cli,
#     and, on a machine of that architecture, prints its version;
#   - the completion scripts are the binary's own, and bash loads the
#     packaged one and completes leasehold with it;
#   - the .rpm (when rpm exists): name, architecture, the same files (zsh's
#     under site-functions), no scriptlet, no requirement but rpmlib's.
set -euo pipefail
# shellcheck source=deploy/nfpm/checklib.sh
. "$(dirname "$0")/checklib.sh"

dist=$1 version=$2 arch=$3
rpm_arch=$(rpm_arch_of "$arch")
deb=$dist/leasehold_${version}_$arch.deb
rpm=$dist/leasehold_${version}_$arch.rpm
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

[ -f "$deb" ] || fail "$deb not found (make packages)"
echo "== $(basename "$deb")"
dpkg-deb --field "$deb" Package Architecture >"$work/fields"
printf 'Package: leasehold\nArchitecture: %s\n' "$arch" >"$work/want"
same "$work/want" "$work/fields" "$deb: control fields"
! dpkg-deb --field "$deb" Depends Pre-Depends | grep -q . || fail "$deb: has dependencies"
dpkg-deb --ctrl-tarfile "$deb" | tar -t | sed 's|^\./||' | grep -v '^$' | sort >"$work/ctrl"
printf 'control\nmd5sums\n' >"$work/want"
same "$work/want" "$work/ctrl" "$deb: control archive (no maintainer script)"

dpkg-deb --contents "$deb" | awk '{ print $1, $2, $6 }' | sort -k3 >"$work/contents"
cat >"$work/want" <<'END'
drwxr-xr-x root/root ./usr/
drwxr-xr-x root/root ./usr/bin/
-rwxr-xr-x root/root ./usr/bin/leasehold
drwxr-xr-x root/root ./usr/share/
drwxr-xr-x root/root ./usr/share/bash-completion/
drwxr-xr-x root/root ./usr/share/bash-completion/completions/
-rw-r--r-- root/root ./usr/share/bash-completion/completions/leasehold
drwxr-xr-x root/root ./usr/share/fish/
drwxr-xr-x root/root ./usr/share/fish/vendor_completions.d/
-rw-r--r-- root/root ./usr/share/fish/vendor_completions.d/leasehold.fish
drwxr-xr-x root/root ./usr/share/zsh/
drwxr-xr-x root/root ./usr/share/zsh/vendor-completions/
-rw-r--r-- root/root ./usr/share/zsh/vendor-completions/_leasehold
END
same "$work/want" "$work/contents" "$deb: files, modes or owners"
echo "files: $(grep -vc '^d' "$work/contents"), no scripts, no dependencies: ok"

root=$work/root
dpkg-deb -x "$deb" "$root"
bin=$root/usr/bin/leasehold
file "$bin" >"$work/file"
has "$work/file" 'statically linked' "leasehold: the binary is not static"
go version -m "$bin" >"$work/buildinfo"
has "$work/buildinfo" '^[[:space:]]+build[[:space:]]+CGO_ENABLED=0$' "leasehold: built with cgo"
has "$work/buildinfo" "^[[:space:]]+build[[:space:]]+GOARCH=$arch\$" "leasehold: not built for $arch"
has "$work/buildinfo" '^[[:space:]]+path[[:space:]]+github.com/leasehold/leasehold/services/cli$' "leasehold: not built from services/cli"
echo "leasehold: static, $arch, cgo off: ok"

if [ "$arch" = "$(go env GOARCH)" ]; then
	"$bin" --version >"$work/version"
	has "$work/version" '^leasehold version ' "leasehold --version"
	for sh in bash zsh fish; do
		"$bin" completion "$sh" >"$work/completion.$sh"
	done
	same "$work/completion.bash" "$root/usr/share/bash-completion/completions/leasehold" "the bash completion is not the binary's own"
	same "$work/completion.zsh" "$root/usr/share/zsh/vendor-completions/_leasehold" "the zsh completion is not the binary's own"
	same "$work/completion.fish" "$root/usr/share/fish/vendor_completions.d/leasehold.fish" "the fish completion is not the binary's own"
	# bash loads it and registers a completion function for leasehold.
	bash --norc -c "source '$root/usr/share/bash-completion/completions/leasehold' && complete -p leasehold" >"$work/complete"
	has "$work/complete" '^complete .*-F __start_leasehold leasehold$' "bash does not complete leasehold with the packaged script"
	echo "leasehold: $(head -c 40 "$work/version"); completions are its own; bash completes with it: ok"
fi

if command -v rpm >/dev/null; then
	[ -f "$rpm" ] || fail "$rpm not found (make packages)"
	echo "== $(basename "$rpm")"
	rpm -qpi "$rpm" >"$work/rpminfo" 2>&1
	has "$work/rpminfo" '^Name +: leasehold$' "$rpm: name is not leasehold"
	has "$work/rpminfo" "^Architecture: $rpm_arch\$" "$rpm: architecture is not $rpm_arch"
	rpm -qp --qf '[%{FILEMODES:perms} %{FILEUSERNAME}/%{FILEGROUPNAME} %{FILENAMES}\n]' "$rpm" | sort -k3 >"$work/rpmfiles"
	cat >"$work/want" <<'END'
-rwxr-xr-x root/root /usr/bin/leasehold
-rw-r--r-- root/root /usr/share/bash-completion/completions/leasehold
-rw-r--r-- root/root /usr/share/fish/vendor_completions.d/leasehold.fish
-rw-r--r-- root/root /usr/share/zsh/site-functions/_leasehold
END
	same "$work/want" "$work/rpmfiles" "$rpm: files, modes or owners"
	[ -z "$(rpm -qp --scripts "$rpm")" ] || fail "$rpm: has scriptlets"
	rpm -qpR "$rpm" | grep -v '^rpmlib(' >"$work/requires" || true
	[ ! -s "$work/requires" ] || {
		cat "$work/requires" >&2
		fail "$rpm: requires more than rpmlib"
	}
	echo "rpm: $rpm_arch, 4 files, no scriptlet, no requirement: ok"
fi
