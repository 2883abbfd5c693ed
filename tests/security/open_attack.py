"""Run as ``python tests/security/open_attack.py ROOT KEY {array,group}``: opens array KEY of the
latest committed step of ROOT with ``ckptd.open_array`` (or through ``ckptd.open_group``) and
reads all of it and a 2-element slice. Prints one JSON line: the outcome (``values`` or
``refused``), the error's type and message, the values read, and this process's peak RSS.
A separate process, so that a hang (a FIFO) is a timeout and memory is measured alone."""

from __future__ import annotations

import json
import sys

import numpy as np

import ckptd


def main(root: str, key: str, how: str) -> dict:
    out: dict = {}
    try:
        if how == "array":
            arr = ckptd.open_array(root, key)
            part = np.asarray(arr[0, 0:2].read().result())
            whole = np.asarray(arr.read().result())
        else:
            arr = ckptd.open_group(root)[f"arrays/{key}"]
            part, whole = np.asarray(arr[0, 0:2]), np.asarray(arr[...])
        out = {"outcome": "values", "part": part.tolist(), "values": whole.tolist()}
    except Exception as e:  # noqa: BLE001 - the test judges the type
        out = {"outcome": "refused", "type": type(e).__name__, "checkpoint_error": isinstance(e, ckptd.CheckpointError)}
        out["message"] = str(e)
    # VmHWM of this process's own memory, not ru_maxrss: Linux carries ru_maxrss over fork and
    # exec, so a child of a large pytest process would report the parent's size
    with open("/proc/self/status") as f:
        hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    out["peak_rss_mb"] = hwm_kb / 1024
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
