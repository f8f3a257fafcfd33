"""The controller process: ``jupyter gpushare controller`` / ``python -m
jupyter_gpushare.controller``.

Wiring only: read config, connect to the API server, serve the HTTP API at once (a standby
answers 503 ``not_leader``), and run the :class:`~.kernels.KernelService` and the reconciler
only while this replica holds the leader Lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from typing import Any

from tornado.httpserver import HTTPServer
from traitlets import Unicode
from traitlets.config import Application

from ..config import GpuShare
from ..k8s import manifests
from ..k8s.client import Kube, connect
from ..k8s.config import KubernetesBackendConfig
from ..k8s.reconcile import Reconciler
from ..k8s.usage import KubernetesUsage, UsageReader
from ..share import ShareSpec
from .api import MAX_BODY, State, make_app
from .auth import HubAuth
from .bounds import Bounds, Quotas, parse_bounds
from .config import GpushareController
from .kernels import KernelService
from .leader import LeaderElection
from .network import KernelNetwork, NetworkSettings
from .queue import ControllerQueue, ControllerQueueSettings
from .queue_api import queue_routes
from .servers import ServerLeases
from .usage import NodeAuth

log = logging.getLogger("jupyter_gpushare.controller")


class ControllerApp(Application):
    name = "jupyter-gpushare-controller"
    description = "The gpushare cluster controller: the only holder of Kubernetes rights."
    classes = [GpushareController, ControllerQueueSettings, KubernetesBackendConfig, GpuShare]
    config_file = Unicode("", config=True, help="A Python config file to load.")
    aliases = {
        "config": "ControllerApp.config_file",
        "port": "GpushareController.port",
        "ip": "GpushareController.ip",
        "hub-url": "GpushareController.hub_url",
        "namespace": "KubernetesBackendConfig.namespace",
        "kubeconfig": "KubernetesBackendConfig.kubeconfig",
        "log-level": "Application.log_level",
    }

    def initialize(self, argv: Any = None) -> None:
        self.parse_command_line(argv)
        if self.config_file:
            self.load_config_file(self.config_file)
            self.parse_command_line(argv)  # the command line wins over the file
        logging.basicConfig(
            level=int(str(self.log_level)), format="%(asctime)s %(levelname)s %(name)s %(message)s"
        )

    def start(self) -> None:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(self.run())

    async def run(self) -> None:
        settings = GpushareController(config=self.config)
        kcfg = KubernetesBackendConfig.instance(config=self.config)
        share = GpuShare.instance(config=self.config)
        queue_settings = ControllerQueueSettings(config=self.config)
        bounds = Bounds(
            parse_bounds(settings.user_bounds, "GpushareController.user_bounds"),
            parse_bounds(settings.group_bounds, "GpushareController.group_bounds"),
            ShareSpec.from_mapping(settings.default_bound) if settings.default_bound else None,
        )
        quotas = Quotas(settings.user_quotas, settings.group_quotas, settings.default_quota or None)
        kube = await connect(kcfg.kubeconfig, kcfg.context)
        state = State(
            HubAuth(settings.hub_url, settings.auth_cache_ttl, settings.auth_cache_size),
            settings.identity,
        )
        leader = LeaderElection(
            kube,
            kcfg.namespace,
            settings.lease_name,
            settings.identity,
            settings.lease_duration,
            settings.renew_interval,
            settings.retry_interval,
        )
        state.leader = leader
        state.node_auth = NodeAuth(kube, kcfg.namespace, settings.daemon_service_account)
        # Node daemons not (yet) configured to report to the controller still write their
        # usage ConfigMaps: read those while no daemon has reported here.
        state.reports.fallback = KubernetesUsage(UsageReader(kube, kcfg.namespace))
        active: dict[str, Any] = {}
        network = (
            KernelNetwork(
                kube,
                kcfg.namespace,
                NetworkSettings.from_config(settings),
                settings.network_policy_grace,
            )
            if settings.network_policies
            else None
        )

        async def started() -> None:
            service = KernelService(
                kube,
                kcfg.namespace,
                share.aliases(),
                share.policy(),
                bounds,
                ServerLeases(
                    kube, kcfg.namespace, settings.server_lease_duration, settings.identity
                ),
                manifests.PodSettings.from_config(kcfg),
                state.reports,
                start_timeout=kcfg.start_timeout,
                admission_wait=kcfg.admission_wait,
                quotas=quotas,
                network=network,
            )
            await service.start(settings.connect_timeout)
            # The caches hold most of this process's objects from now on and live as long as
            # it: keep them out of the cyclic collector's full passes (a pass over 10,000
            # records cost placements up to 5 ms at p99; benchmarks/k8s_scale.py).
            gc.collect()
            gc.freeze()
            reconciler = Reconciler(  # on the service's caches: its passes read nothing
                kube,
                kcfg.namespace,
                None,
                settings.reconcile_grace,
                share.aliases(),
                ledger=service.ledger,
                pods=service.watcher,
                leases=service.servers.leases,
            )
            active["reconcile"] = asyncio.create_task(
                reconciler.run_forever(settings.reconcile_interval)
            )
            if network is not None:  # the per-user NetworkPolicies, on the pod watch's cache
                active["network"] = asyncio.create_task(
                    network.run_forever(settings.reconcile_interval, service.watcher.values)
                )
            # the queue (read from its GpuQueue object) before requests are served
            queue = ControllerQueue(
                service, queue_settings.policy(), settings.identity, queue_settings.server_grace
            )
            await queue.start()
            active["queue"] = queue
            state.queue = queue
            active["service"] = service
            state.service = service

        async def lost() -> None:
            state.service = None
            state.queue = None
            queue = active.pop("queue", None)
            if queue is not None:
                await queue.stop()
            for name in ("reconcile", "network"):
                task = active.pop(name, None)
                if task is not None:
                    task.cancel()
            service = active.pop("service", None)
            if service is not None:
                await service.stop()

        leader.on_started = started
        leader.on_lost = lost
        server = HTTPServer(make_app(state, queue_routes(state)), max_body_size=MAX_BODY)
        server.listen(settings.port, settings.ip)
        log.info(
            "gpushare controller %s listening on %s:%s (namespace %s, hub %s)",
            settings.identity,
            settings.ip,
            settings.port,
            kcfg.namespace,
            settings.hub_url,
        )
        leader.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            server.stop()
            await leader.stop(release=True)
            await _close(kube)


async def _close(kube: Kube) -> None:
    with contextlib.suppress(Exception):
        await kube.close()


def main(argv: list[str] | None = None) -> None:
    app = ControllerApp()
    app.initialize(argv)
    app.start()


__all__ = ["ControllerApp", "main"]
