# Shared by the package checks (check.sh, check-control-plane.sh,
# check-cli.sh), which source it: how they fail and compare, and rpm's
# names of the architectures.

# fail prints its arguments as the check's error and exits 1.
fail() {
	echo "check-packages: $*" >&2
	exit 1
}

# has FILE PATTERN WHAT: FILE has a line matching the extended regular
# expression PATTERN, or FILE is printed and the check fails with WHAT.
has() {
	grep -Eq -- "$2" "$1" || {
		cat "$1" >&2
		fail "$3"
	}
}

# same WANT GOT WHAT: the two files are equal, or their diff is printed and
# the check fails with WHAT.
same() {
	diff -u "$1" "$2" >&2 || fail "$3 (- expected, + found)"
}

# rpm_arch_of GOARCH prints rpm's name of the architecture (x86_64 for
# amd64, aarch64 for arm64, else the same).
rpm_arch_of() {
	case $1 in
	amd64) echo x86_64 ;;
	arm64) echo aarch64 ;;
	*) echo "$1" ;;
	esac
}
