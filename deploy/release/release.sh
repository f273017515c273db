#!/usr/bin/env bash
# Builds a leasehold release (run by `make release` and `make check-release`;
# deploy/README.md, "Releases", says what an operator downloads and how to
# verify it):
#
#   deploy/release/release.sh --version X.Y.Z [--out DIR] [--clean] [--arch "amd64 arm64"] [--quick]
#
# Into DIR (dist/ by default, relative to the repository root; it must be
# empty or absent, or --clean empties it once the version is known to be
# valid), for each linux architecture ARCH:
#
#   leasehold_X.Y.Z_linux_ARCH/             every service and the CLI: static
#                                           (CGO_ENABLED=0), stripped (-s -w),
#                                           -trimpath, stamped with X.Y.Z; with
#                                           LICENSE, CHANGELOG.md and each
#                                           binary's SBOM (BINARY.cdx.json)
#   leasehold_X.Y.Z_linux_ARCH.tar.gz       that directory
#   leasehold-SERVICE_X.Y.Z_ARCH.deb, .rpm  the packages of the node agent and
#                                           of the control-plane services (api,
#                                           gateway, worker, scheduler, doctor,
#                                           site-agent): deploy/nfpm/leasehold-SERVICE.yaml
#   leasehold_X.Y.Z_ARCH.deb, .rpm          the CLI and its shell completions:
#                                           deploy/nfpm/leasehold.yaml
#   ARTIFACT.cdx.json                       the CycloneDX SBOM of each archive
#                                           and package
#   leasehold-common_X.Y.Z_all.deb, .rpm    what the control-plane packages
#                                           share (the user, leasehold.env):
#                                           no binary, so no SBOM
#   SHA256SUMS                              every file above (sha256sum -c)
#
# --quick (make check-release) builds and checks the binaries only: no
# archive, SBOM or package. Every binary is checked: `go version -m` (cgo off,
# -trimpath, the architecture), no symbol table (-s -w), X.Y.Z in its data;
# those the host can run must print X.Y.Z with --version; SHA256SUMS must
# verify.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

version="" out="$root/dist" arches="amd64 arm64" quick=0 clean=0
while [ $# -gt 0 ]; do
	case $1 in
	--version) version=$2; shift 2 ;;
	--out) out=$2; shift 2 ;;
	--arch) arches=$2; shift 2 ;;
	--quick) quick=1; shift ;;
	--clean) clean=1; shift ;;
	*) echo "release: unknown argument $1" >&2; exit 2 ;;
	esac
done

fail() {
	echo "release: $*" >&2
	exit 1
}

# --- the version ---------------------------------------------------------
# Semantic Versioning 2.0.0: MAJOR.MINOR.PATCH, an optional -pre-release and
# +build. The git tag is vX.Y.Z; VERSION is given without the v.
[ -n "$version" ] || fail "VERSION is required: make release VERSION=x.y.z (a semantic version such as 1.4.0 or 1.4.0-rc.1)"
num='(0|[1-9][0-9]*)'
ident='(0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)'
semver="^$num\\.$num\\.$num(-$ident(\\.$ident)*)?(\\+[0-9A-Za-z-]+(\\.[0-9A-Za-z-]+)*)?\$"
if ! [[ $version =~ $semver ]]; then
	hint=""
	[[ $version == v* ]] && hint=" (without the leading v: VERSION=${version#v})"
	fail "VERSION=$version is not a semantic version x.y.z[-pre-release][+build]$hint"
fi
# dpkg and rpm order 1.4.0~rc.1 before 1.4.0; a dash is no part of either's
# version.
pkg_version=${version//-/\~}

revision=${REVISION:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
if [ -z "${REVISION:-}" ] && [ -n "$(git status --porcelain 2>/dev/null)" ]; then
	revision+=-dirty
	[ $quick = 1 ] || echo "release: warning: the working tree has uncommitted changes or untracked files (revision $revision)" >&2
fi
# Archive entries and package files carry the commit's time, not the build's.
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}

if [ $clean = 1 ]; then
	case $(realpath -m "$out") in
	/ | "$root" | "$HOME") fail "--clean would remove $out" ;;
	esac
	rm -rf "$out"
fi
if [ -e "$out" ] && [ -n "$(ls -A "$out")" ]; then
	fail "$out is not empty (--clean empties it)"
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)

# The services and the CLI, as `make build` lists them; the CLI is leasehold.
services=(worker scheduler gateway api site-agent doctor node)
# The services packaged as .deb and .rpm (deploy/nfpm/leasehold-SERVICE.yaml),
# as `make packages` builds them.
packaged=(node api gateway worker scheduler doctor site-agent)
ldflags="-s -w -X github.com/leasehold/leasehold/pkg/buildinfo.version=$version -X github.com/leasehold/leasehold/pkg/buildinfo.revision=$revision"
host_arch=$(go env GOARCH)

cyclonedx() { GOWORK=off go -C "$root/tools/sbom" tool cyclonedx-gomod "$@"; }
sbom_archive() { GOWORK=off go -C "$root/tools/sbom" run ./archive "$@"; }
# nfpm (pinned in tools/go.mod) runs from the repository root: the package's
# file and script paths are relative to it. `go tool -n` prints the binary's
# path once `go tool nfpm` has built it.
nfpm() {
	GOWORK=off go -C "$root/tools" tool nfpm --version >/dev/null
	GOWORK=off go -C "$root/tools" tool -n nfpm
}

[ $quick = 1 ] || nfpm_bin=$(nfpm)
# The CLI's completion scripts, the same for every architecture, from a
# binary for this machine (the package holds them; the archive does not).
completions=$(mktemp -d)
trap 'rm -rf "$completions"' EXIT
if [ $quick = 0 ]; then
	(cd services/cli && go build -o "$completions/leasehold" .)
	for sh in bash zsh fish; do "$completions/leasehold" completion "$sh" >"$completions/completion.$sh"; done
	mv "$completions/completion.bash" "$completions/leasehold.bash"
	mv "$completions/completion.zsh" "$completions/_leasehold"
	mv "$completions/completion.fish" "$completions/leasehold.fish"
fi
start=$SECONDS
for arch in $arches; do
	case $arch in
	amd64 | arm64) ;;
	*) fail "unsupported architecture $arch (amd64, arm64)" ;;
	esac
	name=leasehold_${version}_linux_$arch
	dir=$out/$name
	mkdir -p "$dir"
	bins=()
	for s in "${services[@]}" cli; do
		bin=leasehold-$s
		[ "$s" = cli ] && bin=leasehold
		echo "== $name/$bin"
		(cd "services/$s" && CGO_ENABLED=0 GOOS=linux GOARCH=$arch go build -trimpath -ldflags "$ldflags" -o "$dir/$bin" .)
		bins+=("$bin")
	done

	for bin in "${bins[@]}"; do
		info=$(go version -m "$dir/$bin")
		for want in "build	CGO_ENABLED=0" "build	GOOS=linux" "build	GOARCH=$arch" "build	-trimpath=true"; do
			grep -qF -- "$want" <<<"$info" || fail "$bin ($arch): go version -m lacks \"$want\""
		done
		# -trimpath keeps -ldflags out of the build information: a stripped
		# binary (-s) has no symbol table for go tool nm, and the stamped
		# version is in its data.
		if go tool nm "$dir/$bin" >/dev/null 2>&1; then fail "$bin ($arch): has a symbol table (not built with -s -w)"; fi
		grep -qaF -- "$version" "$dir/$bin" || fail "$bin ($arch): $version is not stamped in it"
		if [ "$arch" = "$host_arch" ]; then
			got=$("$dir/$bin" --version 2>&1) || fail "$bin --version exited $?: $got"
			[[ " ${got//$'\n'/ } " == *" $version "* ]] || fail "$bin --version says \"$got\", not $version"
			echo "$bin --version: $got"
		fi
	done

	[ $quick = 0 ] || continue

	cp LICENSE CHANGELOG.md "$dir/"
	sboms=()
	for bin in "${bins[@]}"; do
		cyclonedx bin -json -noserial -version "$version" -output "$dir/$bin.cdx.json" "$dir/$bin"
		sboms+=("$dir/$bin.cdx.json")
	done
	# gzip's default level: -9 takes three times as long for 0.3% less.
	echo "== $name.tar.gz"
	tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$SOURCE_DATE_EPOCH" \
		-C "$out" -cf - "$name" | gzip -n >"$out/$name.tar.gz"
	sbom_archive -artifact "$out/$name.tar.gz" -version "$version" -out "$out/$name.tar.gz.cdx.json" "${sboms[@]}"

	for s in "${packaged[@]}"; do
		for p in deb rpm; do
			pkg=$out/leasehold-${s}_${version}_$arch.$p
			echo "== $(basename "$pkg")"
			LEASEHOLD_PKG_VERSION=$pkg_version LEASEHOLD_PKG_ARCH=$arch LEASEHOLD_PKG_BINARY=$dir/leasehold-$s \
				"$nfpm_bin" package --config "deploy/nfpm/leasehold-$s.yaml" --packager "$p" --target "$pkg" >/dev/null
			sbom_archive -artifact "$pkg" -version "$version" -out "$pkg.cdx.json" "$dir/leasehold-$s.cdx.json"
		done
	done
	for p in deb rpm; do
		pkg=$out/leasehold_${version}_$arch.$p
		echo "== $(basename "$pkg")"
		LEASEHOLD_PKG_VERSION=$pkg_version LEASEHOLD_PKG_ARCH=$arch LEASEHOLD_PKG_BINARY=$dir/leasehold LEASEHOLD_PKG_COMPLETIONS=$completions \
			"$nfpm_bin" package --config deploy/nfpm/leasehold.yaml --packager "$p" --target "$pkg" >/dev/null
		sbom_archive -artifact "$pkg" -version "$version" -out "$pkg.cdx.json" "$dir/leasehold.cdx.json"
	done
done

# leasehold-common: configuration and scripts, no binary, the same for
# every architecture; tools/sbom/archive describes the binaries an artifact
# holds, and this one holds none, so it has no SBOM (SHA256SUMS lists it).
if [ $quick = 0 ]; then
	for p in deb rpm; do
		pkg=$out/leasehold-common_${version}_all.$p
		echo "== $(basename "$pkg")"
		LEASEHOLD_PKG_VERSION=$pkg_version \
			"$nfpm_bin" package --config deploy/nfpm/leasehold-common.yaml --packager "$p" --target "$pkg" >/dev/null
	done
fi

echo "== SHA256SUMS"
(cd "$out" && find . -type f ! -name SHA256SUMS -printf '%P\n' | LC_ALL=C sort | xargs -d '\n' sha256sum >SHA256SUMS)
(cd "$out" && sha256sum --quiet -c SHA256SUMS) || fail "SHA256SUMS does not verify"
echo "$(wc -l <"$out/SHA256SUMS") files verify against $out/SHA256SUMS"

echo "== leasehold $version (revision $revision) in $out, $((SECONDS - start)) s"
(cd "$out" && find . -maxdepth 1 -type f -printf '%P\n' | LC_ALL=C sort | xargs -d '\n' du -h)
