"""gpushare's device plugin: the kubelet's device-plugin API (v1beta1, gRPC) served by the node
agent (``jupyter gpushare daemon --device-plugin``).

- ``api.proto``: the subset of the kubelet's API we speak; ``api_pb2*.py`` are generated from it
  by grpcio-tools (committed; see DEVELOPING.md to regenerate);
- ``plugin.py``: the plugin. It advertises the node's share capacity (``SHARE_UNITS_PER_GPU``
  units of ``gpushare.jupyter.org/gpu-share`` per healthy GPU) and in ``Allocate`` hands the
  kernel pod being admitted its GPU, the interposer (read-only) and a directory holding only its
  own agent socket, plus the environment. The pure decisions (devices, which pod, the response)
  are functions of plain data, tested without a kubelet.

A DRA driver could later replace it: the same three decisions would become a ResourceSlice, the
claim's allocation and the NodePrepareResources reply.
"""
