"""The kv directory's checks: filesystem and mount options, free space against the snapshot cap,
and that nothing under it is readable by others (the store's mode rule)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING



if TYPE_CHECKING:
    pass

from edge_llm.doctor.probe import FAIL, NA, PASS, WARN, Check, ModelSizes, Probe, GOOD_FS


class StorageChecks(Probe):
    """Checks of the snapshot directory (`Doctor` runs them)."""

    def _existing_kv(self) -> Path | None:
        if not self.o.disk_kv:
            return None
        p = Path(self.o.disk_kv).absolute()
        while not p.exists():
            p = p.parent
        return p.resolve()

    def _mount(self, path: Path) -> tuple[str, str, str, list[str]]:
        """(device, mountpoint, fstype, options) of the longest mountpoint containing `path`."""
        best = ("?", "/", "?", [])
        for line in self._read("proc/self/mounts").splitlines():
            f = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), x) for x in line.split()]
            if len(f) < 4:
                continue
            mp = Path(f[1])
            if (path == mp or mp in path.parents) and len(f[1]) >= len(best[1]):
                best = (f[0], f[1], f[2], f[3].split(","))
        return best

    def kv_filesystem(self) -> Check:
        p = self._existing_kv()
        if p is None:
            return Check("kv-filesystem", NA, "disk KV off")
        dev, mp, fs, opts = self._mount(p)
        detail = f"{self.o.disk_kv} on {dev} ({mp}, {fs}, {','.join(opts)})"
        if "ro" in opts:
            return Check("kv-filesystem", FAIL, detail + ": read-only", "put disk_kv on a writable filesystem")
        notes = []
        if fs in ("tmpfs", "ramfs", "overlay", "squashfs"):
            notes.append(f"{fs} does not keep snapshots across reboots")
        elif fs not in GOOD_FS:
            notes.append(f"{fs}: rename/fsync durability not checked for this filesystem")
        if "sync" in opts:
            notes.append("'sync' makes every snapshot write synchronous")
        if "data=journal" in opts:
            notes.append("data=journal writes every snapshot twice (eMMC wear)")
        if "nobarrier" in opts or "barrier=0" in opts:
            notes.append("barriers off: a power cut can lose fsynced snapshots")
        if notes:
            return Check("kv-filesystem", WARN, detail + "; " + "; ".join(notes),
                         "use ext4/f2fs with default options (noatime is fine) on local flash")
        return Check("kv-filesystem", PASS, detail)

    def kv_space(self, sizes: ModelSizes | None) -> Check:
        p = self._existing_kv()
        if p is None:
            return Check("kv-space", NA, "disk KV off")
        du = shutil.disk_usage(p)
        cap, how = self.o.disk_kv_max_bytes, "disk_kv_max_bytes"
        if cap is None and sizes is not None:
            bpt = sizes.kv_bytes_per_token
            cap, how = self.o.disk_kv_max_files * self.o.disk_kv_max_tokens * bpt, (
                f"{self.o.disk_kv_max_files} files x {self.o.disk_kv_max_tokens} tokens x {bpt} B")
        detail = f"{du.free / 2**30:.2f} GiB free of {du.total / 2**30:.2f} GiB"
        if cap is None:
            return Check("kv-space", WARN, detail + "; snapshot cap unknown (no model, no max_bytes)",
                         "set disk_kv_max_bytes")
        detail += f"; snapshot cap {cap / 2**30:.2f} GiB ({how})"
        if cap > du.free:
            return Check("kv-space", WARN, detail + ": the cap does not fit",
                         "set disk_kv_max_bytes below the free space (leave room for logs and updates)")
        return Check("kv-space", PASS, detail)

    def kv_private(self) -> Check:
        """Snapshots hold conversations (plain token ids): nothing under the kv dir may be
        readable by others (the group only where disk_kv_group_read allows it)."""
        if not self.o.disk_kv:
            return Check("kv-private", NA, "disk KV off")
        p = Path(self.o.disk_kv)
        if not p.is_dir():  # not its parents: their modes are not the store's business
            return Check("kv-private", NA, f"{p} not created yet (the store creates it owner-only)")
        from edge_llm.snapshot.writer import Modes  # the store's rule for its files' modes

        group_ok = self.o.disk_kv_group_read
        bad, n = Modes(group_ok).too_open(p)
        if bad:
            shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            return Check("kv-private", WARN, f"{len(bad)} snapshot path(s) readable by others: {shown}",
                         f"chmod -R go-rwx {p} (the service creates 0600/0700 itself; disk_kv_group_read "
                         "= true lets its group read)")
        return Check("kv-private", PASS, f"{n} path(s) under {p} readable by their owner"
                     + (" and group" if group_ok else "") + " only")
