#!/bin/sh
# leasehold-node postinstall (deb postinst, rpm %post). It never starts the
# agent: the unit waits for `leasehold-node join` (ConditionPathExists on
# the credential), and a package must install in a chroot or a container
# where systemd is not running, so nothing here may fail the install.
#   deb: $1 = configure, $2 = the version replaced (empty on a first install)
#   rpm: $1 = 1 on a first install, 2 or more on an upgrade
set -u

first_install=no
case "${1:-}" in
configure) [ -z "${2:-}" ] && first_install=yes ;;
1) first_install=yes ;;
esac

have_systemctl() { command -v systemctl >/dev/null 2>&1; }
# systemd is the running init (not a chroot, not a container without it).
systemd_running() { [ -d /run/systemd/system ]; }

if have_systemctl && systemd_running; then
	systemctl daemon-reload || true
fi

if [ "$first_install" = yes ]; then
	# Enabled (deb) or as the distribution's preset says (rpm): harmless
	# before the join, since the condition skips the start; after it the
	# agent comes back at every boot. `systemctl enable` and `preset` work
	# offline too (they only write symlinks), so a chroot gets them as well.
	if have_systemctl; then
		if [ "${1:-}" = configure ]; then
			systemctl enable leasehold-node.service >/dev/null 2>&1 || true
		else
			systemctl preset leasehold-node.service >/dev/null 2>&1 || true
		fi
	fi
	if [ ! -e /var/lib/leasehold-node/credential ]; then
		echo "leasehold-node: installed. Join this machine, then start the agent:"
		echo "  leasehold-node join --api-url https://<api>:8080 --token-file <file>"
		echo "  systemctl start leasehold-node"
	fi
	exit 0
fi

# An upgrade: restart a running agent so the new binary runs (running
# commands are stopped and reported). Not when this upgrade is itself a
# command of that agent (an exec of apt-get or dnf): stopping the agent
# would stop the package manager in the middle of its work. The running
# agent keeps the old binary until it is restarted.
if have_systemctl && systemd_running && systemctl is-active --quiet leasehold-node.service; then
	if grep -q 'leasehold-node\.service' /proc/self/cgroup 2>/dev/null; then
		echo "leasehold-node: upgraded from a command of the agent itself: not restarting it now."
		echo "  The new version runs after a restart; as a separate command:"
		echo "  systemd-run --on-active=5 systemctl restart leasehold-node.service"
	else
		systemctl try-restart leasehold-node.service || true
	fi
fi
exit 0
