"""The Kubernetes backend of the gpushare provisioner (box 5) and the ledger on the API server
(box 3).

- :mod:`.config` — ``KubernetesBackendConfig``: the admin's pod template and cluster settings;
- :mod:`.manifests` — pure functions: Pod, Secret, Lease and GpuLedger manifests, Node inventory;
- :mod:`.client` — the one thin layer that calls the API (``kubernetes_asyncio``);
- :mod:`.watch` — the shared pod watch that kernels wait on;
- :mod:`.anchor` — the server's Lease, owner of its kernel pods;
- :mod:`.ledger` — ``KubernetesLedger``: one ``GpuLedger`` object per node, CAS on
  ``resourceVersion``;
- :mod:`.backend` — ``KubernetesKernelBackend``: one pod per kernel;
- :mod:`.reconcile` — releases records of kernels that are gone (run by the node daemon);
- :mod:`.device_plugin` — the kubelet's device-plugin API served by the node daemon: share units
  as an extended resource, each kernel pod's GPU, interposer and own socket in ``Allocate``;
- :mod:`.podsecurity` — the Pod Security Standards (baseline, restricted) as a pure check;
- :mod:`.cli` — ``jupyter gpushare k8s kernel-pod``: the pod a configuration creates, as YAML.

In controller mode (``KubernetesBackendConfig.controller_url``) the server uses none of the API
calls here: :func:`.backend.kernel_backend` returns the thin client of
:mod:`jupyter_gpushare.controller`, which runs this package's ledger, manifests, watch and
reconciler for the whole cluster.
"""
