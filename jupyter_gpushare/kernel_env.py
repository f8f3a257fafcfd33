"""The environment of a process that holds a share, built in one place.

The variables are the contract between whoever starts a kernel and the interposer and node agent
it talks to (DEVELOPING.md "Inside a gpushare kernel"). Three places start one, each with its own
paths, and all build the variables here:

- a local kernel or ``gpushare run`` (:func:`jupyter_gpushare.daemon.env.kernel_env`: this
  machine's socket, ``CUDA_VISIBLE_DEVICES``, the interposer after what is already preloaded);
- a kernel pod's spec in hostPath mode (:func:`jupyter_gpushare.k8s.manifests.kernel_environment`:
  the paths the pod mounts, ``NVIDIA_VISIBLE_DEVICES``);
- the device plugin's ``Allocate`` (:func:`jupyter_gpushare.k8s.device_plugin.plugin.
  container_response`: the pod's own socket directory and read-only interposer).

Pure: no I/O, nothing of the package imported.
"""

from __future__ import annotations

from dataclasses import dataclass

INTERPOSER = "libgpushare.so"


@dataclass(frozen=True)
class Simulated:
    """The simulator as the process sees it: its devices (``GPUSHARE_SIM_DEVICES``), its
    shared state file and the library path that makes ``libcuda.so.1`` the simulator's."""

    devices: str
    state: str
    library_path: str


def preload_last(interposer: str, preloaded: str = "") -> str:
    """``LD_PRELOAD`` with the interposer last, after what ``preloaded`` has (libgpushare
    defines ``dlsym``: a preload that looks itself up with ``dlsym(RTLD_NEXT, …)`` through it
    resolves after libgpushare, so those must come before it)."""
    kept = [p for p in preloaded.split(":") if p and p != interposer]
    return ":".join([*kept, interposer])


def share_environment(
    *,
    allocation_id: str,
    node: str,
    socket: str,
    visible: tuple[str, str],
    interposer: str | None,
    fail_static: tuple[float, int] | None = None,
    simulated: Simulated | None = None,
) -> dict[str, str]:
    """The variables that make a process hold ``allocation_id``'s share.

    ``visible``: the variable naming its GPUs and its value (``CUDA_VISIBLE_DEVICES`` locally,
    ``NVIDIA_VISIBLE_DEVICES`` in pods); ``interposer``: ``LD_PRELOAD``'s value (None: not
    preloaded); ``fail_static``: (request, memory cap) the interposer enforces on its own while
    the node agent is unreachable; ``simulated``: the simulator's variables."""
    env = {
        "GPUSHARE_ALLOCATION_ID": allocation_id,
        "GPUSHARE_SOCKET": socket,
        "GPUSHARE_NODE": node,
        visible[0]: visible[1],
    }
    if fail_static is not None:
        request, memory = fail_static
        env["GPUSHARE_GPU_REQUEST"] = repr(float(request))
        env["GPUSHARE_GPU_MEMORY"] = str(int(memory))
    if interposer is not None:
        env["LD_PRELOAD"] = interposer
    if simulated is not None:
        env.update(
            {
                "GPUSHARE_SIMULATED": "1",
                "GPUSHARE_SIM_DEVICES": simulated.devices,
                "GPUSHARE_SIM_STATE": simulated.state,
                "LD_LIBRARY_PATH": simulated.library_path,
            }
        )
    return env


__all__ = ["INTERPOSER", "Simulated", "preload_last", "share_environment"]
