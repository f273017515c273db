#!/bin/sh
# leasehold-node preremove (deb prerm, rpm %preun): on removal (not on an
# upgrade) stop and disable the agent. Never fails the removal.
#   deb: $1 = remove | upgrade | deconfigure | failed-upgrade
#   rpm: $1 = 0 on removal, 1 or more on an upgrade
set -u

case "${1:-}" in
remove | 0) ;;
*) exit 0 ;;
esac
command -v systemctl >/dev/null 2>&1 || exit 0
systemctl disable leasehold-node.service >/dev/null 2>&1 || true
[ -d /run/systemd/system ] || exit 0
if grep -q 'leasehold-node\.service' /proc/self/cgroup 2>/dev/null; then
	# Removed by a command of the agent: stopping the agent now would stop
	# the package manager too. The agent runs on from its deleted binary
	# until it is stopped.
	echo "leasehold-node: removed from a command of the agent itself: stop it separately:"
	echo "  systemd-run --on-active=5 systemctl stop leasehold-node.service"
	exit 0
fi
systemctl stop leasehold-node.service || true
exit 0
