"""A real JupyterHub for the controller tests: its REST API only (no proxy, no spawning).

``jupyterhub`` runs as a subprocess with the dummy authenticator, a proxy class that routes
nothing (the tests never go through a proxy; the Hub API listens on its own port), a service
token allowed to create users' tokens and groups, and the users and groups the tests name. Each
user's token is made with the scopes JupyterHub gives a user's server
(``users:activity!user``, ``access:servers!server``), so the controller resolves exactly what a
real ``JUPYTERHUB_API_TOKEN`` would show it.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
from cluster import free_port
from servers import spawn, stop_process

SERVER_SCOPES = ["users:activity!user", "access:servers!server"]

CONFIG = """
from jupyterhub.proxy import Proxy


class NoProxy(Proxy):
    should_start = False

    async def add_route(self, routespec, target, data):
        pass

    async def delete_route(self, routespec):
        pass

    async def get_all_routes(self):
        return {{}}


c.JupyterHub.proxy_class = NoProxy
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allowed_users = {users!r}
c.Authenticator.admin_users = {admins!r}
c.JupyterHub.hub_bind_url = "http://{host}:{port}"
c.JupyterHub.bind_url = "http://127.0.0.1:{proxy_port}"
c.JupyterHub.db_url = "sqlite:///{root}/hub.sqlite"
c.JupyterHub.cookie_secret_file = "{root}/cookie_secret"
c.JupyterHub.pid_file = "{root}/hub.pid"
c.JupyterHub.services = [{{"name": "tests", "api_token": {service_token!r}}}]
c.JupyterHub.load_roles = [{{"name": "tests", "scopes": ["admin:users", "tokens", "admin:groups"],
                            "services": ["tests"]}}]
c.JupyterHub.load_groups = {groups!r}
"""


@dataclass
class Hub:
    proc: subprocess.Popen
    url: str
    service_token: str
    log: Path
    tokens: dict[str, str] = field(default_factory=dict)

    def user_token(self, user: str) -> str:
        """A new token of ``user`` with the scopes of a user's server."""
        reply = requests.post(
            f"{self.url}/hub/api/users/{user}/tokens",
            headers={"Authorization": f"token {self.service_token}"},
            json={"scopes": SERVER_SCOPES, "note": "gpushare test server"},
            timeout=30,
        )
        reply.raise_for_status()
        return str(reply.json()["token"])


def start_hub(
    root: Path,
    users: set[str],
    admins: set[str],
    groups: dict[str, list[str]],
    host: str = "127.0.0.1",
) -> Hub:
    """The Hub's API on ``host`` (a real node's pods reach this host at the bridge's address)."""
    root.mkdir(parents=True, exist_ok=True)
    port, service_token = free_port(), secrets.token_hex(16)
    config = root / "jupyterhub_config.py"
    config.write_text(
        CONFIG.format(
            users=users | admins,
            admins=admins,
            host=host,
            port=port,
            proxy_port=free_port(),
            root=root,
            service_token=service_token,
            groups={g: {"users": members} for g, members in groups.items()},
        )
    )
    log = root / "hub.log"
    proc = spawn([sys.executable, "-m", "jupyterhub", "-f", str(config)], log)
    hub = Hub(proc, f"http://{host}:{port}", service_token, log)
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(f"{hub.url}/hub/api/", timeout=5).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError("JupyterHub did not start:\n" + log.read_text()[-4000:])
        time.sleep(0.2)
    for user in sorted(users | admins):
        hub.tokens[user] = hub.user_token(user)
    return hub
