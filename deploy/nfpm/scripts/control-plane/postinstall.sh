#!/bin/sh
# Control-plane postinstall (deb postinst, rpm %post), shared by every
# control-plane package. It reloads systemd so the new or changed unit is
# seen, and nothing more: it never enables, starts or restarts a service.
# A first install cannot run before an operator has set the database URL
# (/etc/leasehold/leasehold.env) and the TLS files; an upgrade leaves a
# running service on its old binary until the operator restarts it, in
# the order docs/runbooks.md ("Upgrades and migrations") asks for
# (migrations first, gateways one at a time). The package must install in
# a chroot or a container where systemd is not running, so nothing here may
# fail the install.
#   deb: $1 = configure, $2 = the version replaced (empty on a first
#        install); abort-* when dpkg unwinds a failed operation
#   rpm: $1 = 1 on a first install, 2 or more on an upgrade
set -u

if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
	systemctl daemon-reload || true
fi

case "${1:-}" in
configure) [ -z "${2:-}" ] && what=install || what=upgrade ;;
1) what=install ;;
[0-9]*) what=upgrade ;;
*) exit 0 ;;
esac

if [ "$what" = install ]; then
	echo "leasehold: installed; not enabled and not started. Before the first start:"
	echo "  /etc/leasehold/leasehold.env    the database URLs and the health token (not for the site agent)"
	echo "  /etc/leasehold/<service>.env    the service's own settings"
	echo "  /etc/leasehold/tls/             certificates and keys, readable by group leasehold"
	echo "then: systemctl enable --now leasehold-<service>"
else
	echo "leasehold: upgraded; a running service keeps its old binary until restarted:"
	echo "  systemctl restart leasehold-<service>   (gateways one at a time: they drain)"
fi
exit 0
