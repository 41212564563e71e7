#!/usr/bin/env bash
# Restart-recovery evidence protocol (docs/evidence.md). Exit 0 only if every check passes.
#
#   tools/test-recovery.sh                                   # local: starts/kills edge-llm serve itself,
#                                                            # on 127.0.0.1 at a free port it prints
#   tools/test-recovery.sh --port 8090                       # local, at this port (must be free)
#   tools/test-recovery.sh --context-tokens 512 --repeats 3  # shorter history
#   tools/test-recovery.sh --base-url http://127.0.0.1:8080 \
#       --log-file /var/log/edge-llm/edge-llm.log --kv-dir /var/lib/edge-llm/kv \
#       --restart-cmd 'systemctl restart edge-llm'           # on a board
#
# Python: $PYTHON if set, else the repo's .venv, else the interpreter of the installed
# `edge-llm` command, else python3. All options: tools/test-recovery.sh --help
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-}"
if [[ -z "$py" && -x "$here/../.venv/bin/python" ]]; then
    py="$here/../.venv/bin/python"
fi
if [[ -z "$py" ]] && command -v edge-llm >/dev/null 2>&1; then
    shebang="$(head -n1 "$(command -v edge-llm)")"
    [[ "$shebang" == "#!"* && -x "${shebang#\#!}" ]] && py="${shebang#\#!}"
fi
exec "${py:-python3}" "$here/recovery_check.py" "$@"
