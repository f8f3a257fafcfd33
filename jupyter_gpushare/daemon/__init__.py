"""The node daemon (DEVELOPING.md, box 6): leases of GPU time and memory caps for the kernels of
one node, enforced together with the interposer ``libgpushare.so`` (box 7).

Modules: :mod:`.wire` (the versioned wire format, shared with ``gpushare_wire.h``),
:mod:`.scheduler` (the pure lease decision), :mod:`.gpu` (one GPU's lease loop), :mod:`.shm`
(shared-memory files), :mod:`.server` (the asyncio daemon), :mod:`.metrics` (Prometheus),
:mod:`.client` (status/refresh client), :mod:`.supervisor` (start one locally), :mod:`.env`
(a kernel's environment), :mod:`.cli` (``jupyter gpushare daemon``).
"""
