#!/bin/sh
# leasehold-node postremove (deb postrm, rpm %postun): forget the removed
# unit file. The state directory (/var/lib/leasehold-node: credential, node
# id, journal) is kept, even on purge: docs/node.md, "Upgrade and
# uninstall", says how to remove the node for good. Never fails.
set -u
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
	systemctl daemon-reload || true
fi
exit 0
