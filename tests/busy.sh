#!/usr/bin/env bash
# `make test-busy`: run a command (the suite) with the machine kept busy beside it, as a user's,
# a packager's or a board's machine is when it runs the suite next to other work: Debian's
# stress-ng with one CPU hog per core at normal priority, and one disk writer (write, fsync,
# remove, in a scratch directory on the disk the suite's temp files use). The load average is
# sampled every 30 s and printed at the end with the command's time; the hog is stopped whatever
# the command does, and stops by itself after --timeout in any case. Usage: tests/busy.sh CMD...
set -euo pipefail
command -v stress-ng >/dev/null || { echo "busy.sh: stress-ng is missing (apt-get install stress-ng)" >&2; exit 2; }
scratch=$(mktemp -d "${TMPDIR:-/tmp}/edge-llm-busy.XXXXXX")
loads="$scratch/loadavg"
stress-ng --cpu "$(nproc)" --cpu-method matrixprod --hdd 1 --hdd-bytes 512M --temp-path "$scratch" \
    --timeout 3h --quiet &
hog=$!
( while sleep 30; do cut -d' ' -f1 /proc/loadavg >> "$loads"; done ) &
sampler=$!
cleanup() { kill "$hog" "$sampler" 2>/dev/null || true; wait "$hog" 2>/dev/null || true; rm -rf "$scratch"; }
trap cleanup EXIT
start=$(date +%s)
status=0
"$@" || status=$?
secs=$(( $(date +%s) - start ))
if [ -s "$loads" ]; then
    summary=$(sort -n "$loads" | awk '{v[NR]=$1} END {printf "load average over the run: min %s, median %s, max %s (%d samples)", v[1], v[int((NR+1)/2)], v[NR], NR}')
else
    summary="load average: no sample (the run took under 30 s)"
fi
echo "busy.sh: '$*' exited $status after ${secs} s beside $(nproc) CPU hog(s) and a disk writer; $summary"
exit "$status"
