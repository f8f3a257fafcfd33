"""The Kubernetes Pod Security Standards ("baseline" and "restricted", policy version 1.30+), as a
pure check over a Pod manifest: the list of rules a pod breaks, in the words of the standard.

Used by the tests (kernel pods must pass "restricted") and by ``jupyter gpushare k8s
kernel-pod`` (which prints what the pod would break, so an admin can review it). It mirrors
https://kubernetes.io/docs/concepts/security/pod-security-standards/ field by field; it does
not replace the admission controller.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

#: capabilities the baseline level lets a container add
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES = frozenset(
    {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
)
#: volume types the restricted level allows
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
APPARMOR_PREFIX = "container.apparmor.security.beta.kubernetes.io/"


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(kind) or []:
            yield f"{kind}[{c.get('name', '?')}]", c


def baseline_violations(pod: Mapping[str, Any]) -> list[str]:
    """The baseline rules ``pod`` breaks (empty: it passes baseline)."""
    spec = pod.get("spec") or {}
    meta = pod.get("metadata") or {}
    out: list[str] = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"host namespaces: spec.{field} must be unset or false")
    psc = spec.get("securityContext") or {}
    if (spec.get("os") or {}).get("name") != "windows" and (psc.get("windowsOptions") or {}).get(
        "hostProcess"
    ):
        out.append("HostProcess: spec.securityContext.windowsOptions.hostProcess must be false")
    for vol in spec.get("volumes") or []:
        if "hostPath" in vol:
            out.append(f"hostPath volumes: volume {vol.get('name')!r} is a hostPath")
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctls: {sysctl.get('name')} is not a safe sysctl")
    out += _selinux("spec.securityContext", psc)
    out += _seccomp_baseline("spec.securityContext", psc)
    out += _apparmor("spec.securityContext", psc)
    for key, value in (meta.get("annotations") or {}).items():
        if (
            key.startswith(APPARMOR_PREFIX)
            and value not in ("runtime/default",)
            and not str(value).startswith("localhost/")
        ):
            out.append(f"AppArmor: annotation {key}={value} must be runtime/default or localhost/*")
    for where, c in _containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"privileged containers: {where}.securityContext.privileged must be false")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where} must not be a host process")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"capabilities: {where} adds {sorted(added - BASELINE_CAPABILITIES)}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"host ports: {where} uses hostPort {port['hostPort']}")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"/proc mount type: {where}.securityContext.procMount must be Default")
        out += _selinux(f"{where}.securityContext", sc)
        out += _seccomp_baseline(f"{where}.securityContext", sc)
        out += _apparmor(f"{where}.securityContext", sc)
    return out


def restricted_violations(pod: Mapping[str, Any]) -> list[str]:
    """The restricted rules (baseline included) ``pod`` breaks (empty: it passes restricted)."""
    spec = pod.get("spec") or {}
    out = baseline_violations(pod)
    for vol in spec.get("volumes") or []:
        bad = [k for k in vol if k != "name" and k not in RESTRICTED_VOLUMES]
        if bad:
            out.append(
                f"volume types: volume {vol.get('name')!r} is {bad[0]} (allowed: "
                f"{', '.join(sorted(RESTRICTED_VOLUMES))})"
            )
    psc = spec.get("securityContext") or {}
    pod_non_root = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if psc.get("runAsUser") == 0:
        out.append("running as non-root user: spec.securityContext.runAsUser must not be 0")
    for where, c in _containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(
                f"privilege escalation: {where}.securityContext.allowPrivilegeEscalation "
                "must be false"
            )
        non_root = sc.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(f"running as non-root: {where} must set runAsNonRoot: true (or the pod)")
        if sc.get("runAsUser") == 0:
            out.append(f"running as non-root user: {where}.securityContext.runAsUser must not be 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(
                f"seccomp: {where} needs seccompProfile RuntimeDefault or Localhost (or the pod's)"
            )
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"capabilities: {where}.securityContext.capabilities.drop must include ALL")
        extra = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if extra:
            out.append(f"capabilities: {where} may add only NET_BIND_SERVICE, adds {sorted(extra)}")
    return out


def _selinux(where: str, sc: Mapping[str, Any]) -> list[str]:
    opts = sc.get("seLinuxOptions") or {}
    out = []
    if opts.get("type", "") not in SELINUX_TYPES:
        out.append(f"SELinux: {where}.seLinuxOptions.type {opts['type']!r} is not allowed")
    for key in ("user", "role"):
        if opts.get(key):
            out.append(f"SELinux: {where}.seLinuxOptions.{key} must be unset")
    return out


def _seccomp_baseline(where: str, sc: Mapping[str, Any]) -> list[str]:
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        return [f"seccomp: {where}.seccompProfile.type must not be Unconfined"]
    return []


def _apparmor(where: str, sc: Mapping[str, Any]) -> list[str]:
    kind = (sc.get("appArmorProfile") or {}).get("type")
    if kind not in (None, "RuntimeDefault", "Localhost"):
        return [f"AppArmor: {where}.appArmorProfile.type must be RuntimeDefault or Localhost"]
    return []


__all__ = ["baseline_violations", "restricted_violations"]
