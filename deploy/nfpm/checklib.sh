# Shared by the package checks (check.sh, check-control-plane.sh,
# check-cli.sh), which source it: how they fail and compare.

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
