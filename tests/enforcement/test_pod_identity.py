"""The daemon's pod identity (``daemon/identity.py``): the pod UID in ``/proc/<pid>/cgroup`` as
the kubelet lays it out with either cgroup driver, in cgroup v1 and v2 (pure parsing, plus the
reading of a live and of a missing process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jupyter_gpushare.daemon.identity import pod_uid_from_cgroups, pod_uid_of

UID = "0d3a5e9c-1b2f-4c6d-8e7f-9a0b1c2d3e4f"


@pytest.mark.parametrize(
    "text",
    [
        # cgroup v1, cgroupfs driver
        f"12:pids:/kubepods/burstable/pod{UID}/4f2c0a\n11:memory:/kubepods/burstable/pod{UID}/4f2c0a",
        # cgroup v1, systemd driver (dashes of the UID become underscores)
        "5:cpu,cpuacct:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
        f"{UID.replace('-', '_')}.slice/cri-containerd-4f2c0a.scope",
        # cgroup v2, systemd driver, read from the host
        f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-4f2c0a.scope",
        # cgroup v2 read from a daemon in its own cgroup namespace (path relative to it)
        f"0::/../../kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
        "cri-containerd-4f2c0a.scope",
    ],
)
def test_pod_uid_is_read_with_either_driver_and_cgroup_version(text: str) -> None:
    assert pod_uid_from_cgroups(text) == UID


@pytest.mark.parametrize(
    "text",
    [
        "0::/",
        "0::/user.slice/user-1000.slice/session-3.scope",
        "8:pids:/system.slice/docker-4f2c0a.scope",
        "0::/kubepods.slice/kubepods-burstable.slice",  # the QoS level, no pod
        "",
    ],
)
def test_no_pod_uid_outside_a_pod(text: str) -> None:
    assert pod_uid_from_cgroups(text) is None


def test_a_process_is_read_from_proc_and_a_missing_one_is_in_no_pod() -> None:
    mine = Path(f"/proc/{os.getpid()}/cgroup").read_text()
    assert pod_uid_of(os.getpid()) == pod_uid_from_cgroups(mine)
    assert pod_uid_of(2**22 + 12345) is None  # above pid_max: no such process
