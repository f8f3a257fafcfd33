"""The one place that talks to the Kubernetes API (``kubernetes_asyncio``; nothing blocks the loop).

:class:`Kube` bundles an ``ApiClient`` with the few API groups gpushare uses. Everything is plain
JSON dicts (``_preload_content=False`` for reads), so manifests built by :mod:`.manifests` and
objects read back have one shape.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from tornado.web import HTTPError


class ClusterError(HTTPError):
    """Something the cluster did or could not do, in its words: an HTTP 503 with ``reason``,
    so that REST calls and jupyter_server's ``POST /api/kernels`` answer with the message rather
    than "Unhandled error"."""

    reason_code = "cluster_error"

    def __init__(self, message: str) -> None:
        super().__init__(503, log_message=message, reason=self.reason_code)
        self.message = message

    def __str__(self) -> str:
        return self.message


GROUP = "gpushare.jupyter.org"
VERSION = "v1alpha1"
LEDGER_PLURAL = "gpuledgers"

__all__ = ["GROUP", "LEDGER_PLURAL", "VERSION", "ApiException", "Kube", "connect"]


async def connect(kubeconfig: str = "", context: str = "") -> Kube:
    """An API client: from ``kubeconfig`` if given, in-cluster when running in a pod, else the
    default kubeconfig ($KUBECONFIG, ~/.kube/config)."""
    configuration = client.Configuration()
    if kubeconfig:
        await config.load_kube_config(
            config_file=kubeconfig, context=context or None, client_configuration=configuration
        )
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        await config.load_kube_config(context=context or None, client_configuration=configuration)
    # Many kernels, reconcilers and placers share one client: allow enough connections.
    configuration.connection_pool_maxsize = 64
    return Kube(client.ApiClient(configuration))


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.coordination = client.CoordinationV1Api(api)
        self.networking = client.NetworkingV1Api(api)

    async def close(self) -> None:
        await self.api.close()

    # -- reads as JSON ---------------------------------------------------------------------------

    @staticmethod
    async def _json(coro: Any) -> dict[str, Any]:
        """Await a ``_preload_content=False`` call: the body as JSON, or :class:`ApiException`
        (with ``_preload_content=False`` the generated client raises nothing by itself)."""
        response = await coro
        try:
            body = await response.read()
        finally:
            response.release()
        if not 200 <= response.status <= 299:
            exc = ApiException(status=response.status, reason=response.reason)
            exc.body = body.decode(errors="replace")
            with contextlib.suppress(ValueError, AttributeError):
                exc.reason = json.loads(body).get("message") or exc.reason
            raise exc
        return json.loads(body) if body else {}

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._json(
                self.core.read_namespaced_pod(name, namespace, _preload_content=False)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def list_pods(self, namespace: str, label_selector: str = "") -> dict[str, Any]:
        return await self._json(
            self.core.list_namespaced_pod(
                namespace, label_selector=label_selector, _preload_content=False
            )
        )

    async def read_node(self, name: str) -> dict[str, Any]:
        return await self._json(self.core.read_node(name, _preload_content=False))

    async def list_nodes(self) -> list[dict[str, Any]]:
        return (await self._json(self.core.list_node(_preload_content=False)))["items"]

    async def list_ledgers(self, namespace: str) -> dict[str, Any]:
        return await self._json(
            self.custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, LEDGER_PLURAL, _preload_content=False
            )
        )

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._json(
                self.coordination.read_namespaced_lease(name, namespace, _preload_content=False)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def list_leases(self, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
        return (
            await self._json(
                self.coordination.list_namespaced_lease(
                    namespace, label_selector=label_selector, _preload_content=False
                )
            )
        )["items"]

    # -- writes (bodies are dicts) ---------------------------------------------------------------

    async def create_pod(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._json(
            self.core.create_namespaced_pod(namespace, body, _preload_content=False)
        )

    async def delete_pod(self, namespace: str, name: str, grace: int | None = None) -> bool:
        """Delete a pod; False when it was already gone."""
        try:
            await self._json(
                self.core.delete_namespaced_pod(
                    name, namespace, grace_period_seconds=grace, _preload_content=False
                )
            )
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._json(
            self.core.create_namespaced_secret(namespace, body, _preload_content=False)
        )

    async def set_secret_owners(
        self, namespace: str, name: str, owners: list[dict[str, Any]]
    ) -> None:
        """Replace a Secret's ownerReferences (a JSON patch: a strategic merge would add)."""
        patch = [{"op": "replace", "path": "/metadata/ownerReferences", "value": owners}]
        await self._json(
            self.core.patch_namespaced_secret(name, namespace, patch, _preload_content=False)
        )

    async def delete_secret(self, namespace: str, name: str) -> bool:
        try:
            await self._json(
                self.core.delete_namespaced_secret(name, namespace, _preload_content=False)
            )
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._json(
            self.coordination.create_namespaced_lease(namespace, body, _preload_content=False)
        )

    async def replace_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._json(
            self.coordination.replace_namespaced_lease(
                body["metadata"]["name"], namespace, body, _preload_content=False
            )
        )

    async def delete_lease(self, namespace: str, name: str, uid: str | None = None) -> bool:
        """Delete a Lease (only the one with ``uid``, when given); False when it was gone."""
        options = {"preconditions": {"uid": uid}} if uid else None
        try:
            await self._json(
                self.coordination.delete_namespaced_lease(
                    name,
                    namespace,
                    propagation_policy="Background",
                    body=options,
                    _preload_content=False,
                )
            )
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def patch_node(self, name: str, patch: dict[str, Any]) -> None:
        await self._json(self.core.patch_node(name, patch, _preload_content=False))

    async def create_ledger(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._json(
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, LEDGER_PLURAL, body, _preload_content=False
            )
        )

    async def replace_ledger(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._json(
            self.custom.replace_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                LEDGER_PLURAL,
                body["metadata"]["name"],
                body,
                _preload_content=False,
            )
        )

    async def list_network_policies(
        self, namespace: str, label_selector: str = ""
    ) -> list[dict[str, Any]]:
        return (
            await self._json(
                self.networking.list_namespaced_network_policy(
                    namespace, label_selector=label_selector, _preload_content=False
                )
            )
        )["items"]

    async def create_network_policy(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._json(
            self.networking.create_namespaced_network_policy(
                namespace, body, _preload_content=False
            )
        )

    async def delete_network_policy(self, namespace: str, name: str) -> bool:
        """Delete a NetworkPolicy; False when it was already gone."""
        try:
            await self._json(
                self.networking.delete_namespaced_network_policy(
                    name, namespace, _preload_content=False
                )
            )
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    # -- watches ---------------------------------------------------------------------------------

    def lister(self, kind: str, namespace: str) -> tuple[Any, tuple[Any, ...]]:
        """The client's LIST function for ``kind`` ('pods', 'gpuledgers', 'leases',
        'configmaps' and 'networkpolicies' in ``namespace``; 'nodes' cluster-wide) and its
        positional arguments: a listing (:func:`.watch.list_objects`) and a watch
        (:meth:`watch`) call the same one."""
        if kind == "pods":
            return self.core.list_namespaced_pod, (namespace,)
        if kind == "gpuledgers":
            ledgers = (GROUP, VERSION, namespace, LEDGER_PLURAL)
            return self.custom.list_namespaced_custom_object, ledgers
        if kind == "nodes":
            return self.core.list_node, ()
        if kind == "leases":
            return self.coordination.list_namespaced_lease, (namespace,)
        if kind == "configmaps":
            return self.core.list_namespaced_config_map, (namespace,)
        if kind == "networkpolicies":
            return self.networking.list_namespaced_network_policy, (namespace,)
        raise ValueError(
            f"kind {kind!r} is not one of pods, gpuledgers, nodes, leases, configmaps, "
            "networkpolicies"
        )

    async def watch(
        self,
        kind: str,
        namespace: str,
        resource_version: str,
        timeout_seconds: int = 240,
        on_response: Any = None,
        **params: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """Raw watch events (``{"type", "object"}``, objects as dicts) of ``kind`` ('pods' or
        'gpuledgers') after ``resource_version``; ends when the server closes the stream
        (``timeout_seconds``). Raises :class:`ApiException` (410 when the version is too old).
        ``kind`` may also be 'nodes' (cluster-wide), 'leases', 'configmaps' or
        'networkpolicies' (informers, :mod:`.watch`); ``on_response`` is given the open stream
        (so it can be closed).

        Our own line reader rather than ``kubernetes_asyncio.watch``: no model decoding (the
        ledger's placers and the pod watcher only need dicts) and no hidden reconnects."""
        func, args = self.lister(kind, namespace)
        response = await func(
            *args,
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_seconds,
            _preload_content=False,
            **params,
        )
        if not 200 <= response.status <= 299:
            await self._json(_done(response))  # raises ApiException
        if on_response is not None:
            on_response(response)
        buffer = b""
        try:
            # Chunks, not aiohttp's line iterator: its lines are capped at 64 KiB, and a
            # GpuLedger with many allocations can be larger.
            async for chunk in response.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _event(line)
            if buffer.strip():
                yield _event(buffer)
        finally:
            response.release()


async def _done(value: Any) -> Any:
    return value


def _event(line: bytes) -> dict[str, Any]:
    event = json.loads(line)
    if event.get("type") == "ERROR":
        status = event.get("object") or {}
        raise ApiException(
            status=int(status.get("code", 500)), reason=str(status.get("message", "watch error"))
        )
    return event
