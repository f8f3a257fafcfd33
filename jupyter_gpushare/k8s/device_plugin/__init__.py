"""gpushare's device plugin: the kubelet's device-plugin API (v1beta1, gRPC) served by the node
agent (``jupyter gpushare daemon --device-plugin``).

- ``api.proto``: the subset of the kubelet's API we speak; ``podresources.proto``: the subset of
  its PodResources API (v1) the plugin asks which pod holds a container's devices; the
  ``*_pb2*.py`` modules are generated from them by grpcio-tools (committed; see DEVELOPING.md
  to regenerate);
- ``plugin.py``: the plugin. It advertises the node's share capacity (``SHARE_UNITS_PER_GPU``
  units of ``gpushare.jupyter.org/gpu-share`` per healthy GPU) and in ``Allocate`` hands the
  kernel pod being admitted its GPU, the interposer (read-only) and a directory holding only its
  own agent socket, plus the environment; in ``PreStartContainer`` it refuses a container whose
  pod (as PodResources names it) is not the one ``Allocate`` took its devices for. The pure
  decisions (devices, which pod, who holds which device, the response) are functions of plain
  data, tested without a kubelet.

A DRA driver could later replace it: the same three decisions would become a ResourceSlice, the
claim's allocation and the NodePrepareResources reply.
"""
