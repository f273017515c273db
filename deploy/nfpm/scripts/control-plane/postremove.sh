#!/bin/sh
# Control-plane postremove (deb postrm, rpm %postun), shared by every
# control-plane package: systemd forgets the removed unit (or sees the
# upgraded one). Configuration in /etc/leasehold is a conffile: kept on
# remove, deleted on purge (deb) or kept as .rpmsave when edited (rpm). The
# system user and the site agent's /var/lib/leasehold (image cache, TFTP
# root, command journal) are kept, even on purge. Never fails.
set -u
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
	systemctl daemon-reload || true
fi
exit 0
