"""The cluster control point (DEVELOPING.md, box 12): the only holder of Kubernetes rights.

Users' Jupyter servers call it over HTTP as their JupyterHub user; it places shares, writes the
GpuLedgers, builds and creates kernel pods and their Secrets, watches and reconciles them.

- :mod:`.config` — ``GpushareController``: the admin's settings (Hub, bounds, leader Lease);
- :mod:`.errors` — the one error model of the API (``ControllerError`` as JSON);
- :mod:`.auth` — the trust boundary: Hub API token -> :class:`~.auth.HubUser` (cached);
- :mod:`.bounds` — per-user and per-group bounds (pure);
- :mod:`.leader` — leader election on a Lease (one active replica);
- :mod:`.servers` — the users' server Leases, renewed on their heartbeats;
- :mod:`.kernels` — ``KernelService``: place, launch, resize, release, authorized by user;
- :mod:`.api` — the tornado handlers;
- :mod:`.app` — the process (``jupyter gpushare controller``);
- :mod:`.client` — what a user's server uses to call it.
"""
