#!/usr/bin/env bash
# Remove the edge-llm service installed by board/install.sh (run as root). Idempotent.
#
#   sudo board/uninstall.sh            # keeps snapshots, logs, config and models
#   sudo board/uninstall.sh --purge    # also /var/lib/edge-llm, /var/log/edge-llm,
#                                      # /etc/edge-llm, /opt/edge-llm/models and the user
#   board/uninstall.sh --root DIR      # staging tree made by install.sh --root DIR
set -euo pipefail

ROOT=""
PURGE=0
SVC_USER="edge-llm"

log() { printf 'uninstall: %s\n' "$*"; }
die() { printf 'uninstall: error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --root) ROOT="${2:?--root needs a directory}"; shift 2 ;;
    --purge) PURGE=1; shift ;;
    -h|--help) sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option: $1 (see --help)" ;;
  esac
done
if [ -n "$ROOT" ]; then
  [ -d "$ROOT" ] || die "--root $ROOT: no such directory"
  ROOT="$(cd "$ROOT" && pwd)"
  [ "$ROOT" != "/" ] || ROOT=""
fi
[ -n "$ROOT" ] || [ "$(id -u)" -eq 0 ] || die "run as root (or use --root DIR)"

host() {
  if [ -n "$ROOT" ]; then log "skip (--root): $*"; else log "run: $*"; "$@"; fi
}
remove() {  # paths relative to the target root
  local p
  for p in "$@"; do
    if [ -e "$ROOT$p" ] || [ -L "$ROOT$p" ]; then rm -rf -- "$ROOT$p"; log "removed $p"; fi
  done
}

UNIT=/etc/systemd/system/edge-llm.service
if [ -e "$ROOT$UNIT" ]; then
  # stop first: SIGTERM lets the server flush a pending snapshot (TimeoutStopSec=90)
  host systemctl disable --now edge-llm.service
  if [ -n "$ROOT" ]; then systemctl --root="$ROOT" disable edge-llm.service; fi
fi
remove "$UNIT" \
  /etc/systemd/journald.conf.d/edge-llm.conf \
  /etc/logrotate.d/edge-llm \
  /etc/edge-llm/edge-llm.toml.example \
  /opt/edge-llm/venv \
  /opt/edge-llm/share
# leftovers of a disable that ran without the unit file
remove /etc/systemd/system/multi-user.target.wants/edge-llm.service
rmdir "$ROOT/etc/systemd/journald.conf.d" 2>/dev/null || true

if [ "$PURGE" -eq 1 ]; then
  remove /var/lib/edge-llm /var/log/edge-llm /etc/edge-llm /opt/edge-llm \
    /etc/systemd/system/edge-llm.service.d /etc/default/edge-llm
  if [ -n "$ROOT" ]; then
    if grep -q "^$SVC_USER:" "$ROOT/etc/passwd" 2>/dev/null; then userdel --prefix "$ROOT" "$SVC_USER"; fi
    if grep -q "^$SVC_USER:" "$ROOT/etc/group" 2>/dev/null; then groupdel --prefix "$ROOT" "$SVC_USER"; fi
  else
    if id -u "$SVC_USER" >/dev/null 2>&1; then userdel "$SVC_USER"; fi
    if getent group "$SVC_USER" >/dev/null; then groupdel "$SVC_USER"; fi
  fi
  log "purged snapshots, logs, config, models and the $SVC_USER user"
else
  rmdir "$ROOT/opt/edge-llm/models" "$ROOT/opt/edge-llm" 2>/dev/null || true
  log "kept /var/lib/edge-llm (snapshots), /var/log/edge-llm, /etc/edge-llm and the $SVC_USER user (--purge removes them)"
fi
host systemctl daemon-reload
host systemctl restart systemd-journald.service
log "done"
