"""Which pod a process runs in, from its control groups (the node daemon's peer check for
kernel pods).

A kernel in a pod has no host PID in its allocation record (the server cannot know it), so the
daemon identifies the pod instead: the kubelet puts every container's processes into a cgroup
whose path carries the pod's UID — ``…/kubepods/burstable/pod<uid>/<container>`` with the
cgroupfs driver, ``…/kubepods-burstable-pod<uid_with_underscores>.slice/…`` with the systemd
driver, in cgroup v1 and v2 alike. The path is set by the kubelet, not by the process, so a
process cannot claim another pod's identity. The daemon must see the node's processes
(``hostPID: true``) for the PID from ``SO_PEERCRED`` to mean a host process.
"""

from __future__ import annotations

import re

_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
)


def pod_uid_from_cgroups(text: str) -> str | None:
    """The pod UID in the text of a ``/proc/<pid>/cgroup`` file, or None (not in a pod)."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        match = _POD_UID.search(path)
        if match:
            return match.group(1).replace("_", "-")
    return None


def pod_uid_of(pid: int) -> str | None:
    """The UID of the pod process ``pid`` runs in; None when it is in none or is gone."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="ascii", errors="replace") as f:
            return pod_uid_from_cgroups(f.read())
    except OSError:
        return None
