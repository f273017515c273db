#!/bin/sh
# Control-plane preinstall (deb preinst, rpm %pre), shared by leasehold-common
# and every control-plane package (api, gateway, worker, scheduler, doctor,
# site-agent): creates the system group and user `leasehold` the units run
# as (User=leasehold, Group=leasehold), unless they exist. It runs before
# the package's files are unpacked, so files and directories the package
# gives to leasehold (/etc/leasehold/tls, the site agent's /var/lib/leasehold)
# get their owner. Idempotent: any package may run it first, every upgrade
# runs it again. Never removed: no package deletes the user (files it owns
# may outlive the packages).
#   deb: $1 = install | upgrade; rpm: $1 = 1 on a first install, 2 or more
#   on an upgrade. Neither matters here.
set -eu

name=leasehold
home=/var/lib/leasehold
shell=/bin/false
for s in /usr/sbin/nologin /sbin/nologin; do
	if [ -x "$s" ]; then
		shell=$s
		break
	fi
done

# useradd and groupadd: passwd on Debian (a Pre-Depends of the .deb),
# shadow-utils on RPM distributions; Debian's adduser where they are missing.
if command -v useradd >/dev/null 2>&1 && command -v groupadd >/dev/null 2>&1; then
	if ! getent group "$name" >/dev/null 2>&1; then
		groupadd --system "$name"
	fi
	if ! getent passwd "$name" >/dev/null 2>&1; then
		useradd --system --gid "$name" --home-dir "$home" --no-create-home \
			--shell "$shell" --comment "leasehold control plane" "$name"
	fi
elif command -v adduser >/dev/null 2>&1; then
	if ! getent group "$name" >/dev/null 2>&1; then
		addgroup --system "$name"
	fi
	if ! getent passwd "$name" >/dev/null 2>&1; then
		adduser --system --ingroup "$name" --home "$home" --no-create-home \
			--shell "$shell" --gecos "leasehold control plane" --disabled-password "$name"
	fi
else
	echo "leasehold: neither useradd nor adduser found: cannot create the system user $name" >&2
	exit 1
fi
exit 0
