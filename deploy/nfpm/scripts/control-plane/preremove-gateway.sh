#!/bin/sh
# leasehold-gateway preremove (deb prerm, rpm %preun): on removal, not on an
# upgrade, disable and stop its units, so nothing runs a deleted binary or
# starts it again at boot. One file per package because nfpm takes scripts
# as they are (no ${VAR} expansion): the unit list is the only difference.
# Never fails the removal.
#   deb: $1 = remove | upgrade | deconfigure | failed-upgrade
#   rpm: $1 = 0 on removal, 1 or more on an upgrade
set -u
units="leasehold-gateway.service"

case "${1:-}" in
remove | 0) ;;
*) exit 0 ;;
esac
command -v systemctl >/dev/null 2>&1 || exit 0
# disable works without a running systemd too (it removes symlinks).
systemctl disable $units >/dev/null 2>&1 || true
[ -d /run/systemd/system ] || exit 0
systemctl stop $units || true
exit 0
