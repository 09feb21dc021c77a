"""The controller of the multi-host test: runs inside the LAN's hub namespace (``ip netns exec <hub>``).

Usage: python multihost_driver.py TAG PREFIX WORK TOKEN

Starts the local S3 server on the hub's bridge address, then the project's deployment split over
three host namespaces of the LAN (``multihost_support.Lan``): ``h1`` the fake backend and the
policy model, ``h2`` the agent, ``h3`` the resources and environment servers; each server binds its
host's address and is called there, each host has a directory of its own (cwd of the backend,
logs, ``TMPDIR``, Gym's results and cache, the fsspec backend's spool) and no directory is shared:
the checkpoint goes to ``s3://``. Then ``crash_scenario.run_scenario``: rollouts in flight,
prepare, commit into S3, SIGKILL every host (each namespace deleted with everything in it, its
directory removed), fresh hosts (new namespaces and directories, same addresses), restore from
S3, every rollout finished. Last, ``ng-checkpoint verify`` of the checkpoint. Prints one JSON
object as its last line: the scenario's result, verify's exit status and output, what each host
listened on, the checkpoint's objects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
from multihost_support import Lan
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin._storage import objstore
from nemo_gym_checkpoint_plugin.testing.crash_scenario import run_scenario
from nemo_gym_checkpoint_plugin.testing.gym_config import (
    AGENT,
    BACKEND,
    DEFAULT_CHECKPOINT_BLOCK,
    ENVIRONMENT,
    FAKE_MODEL_NAME,
    MODEL,
    PORT_OFFSETS,
    RESOURCES,
    TOKEN_ENV,
    build_gym_config,
    wrapped_entrypoints,
)
from nemo_gym_checkpoint_plugin.testing.process_specs import FAKE_BACKEND_MODULE, ProcessSpec, gym_specs
from nemo_gym_checkpoint_plugin.testing.s3_server import LocalS3Server

PLACEMENT = {"h1": [BACKEND, MODEL], "h2": [AGENT], "h3": [RESOURCES, ENVIRONMENT]}
PORT_BASE = 18200
CONTINUED = [f"cont-{i}" for i in range(4)]
RESTARTS = [f"rest-{i}" for i in range(2)]
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class MultiHostDeployment:
    """What ``run_scenario`` needs of a deployment (``urls``, ``config``, ``process_groups``, ``start``,
    ``kill``), for servers spread over the LAN's host namespaces."""

    def __init__(self, lan: Lan, work: Path, token: str, store_env: dict[str, str]) -> None:
        self.lan, self.work, self.token, self.store_env = lan, work, token, store_env
        self.addresses = {host: f"{lan.prefix}.{10 + number}" for number, host in enumerate(PLACEMENT, 1)}
        self.host_of = {name: host for host, names in PLACEMENT.items() for name in names}
        block = {**DEFAULT_CHECKPOINT_BLOCK, "storage": {"backend": "fsspec"}}
        self._config = build_gym_config(
            PORT_BASE,
            work,
            checkpoint=block,
            entrypoints=wrapped_entrypoints(),
            hosts={name: self.addresses[host] for name, host in self.host_of.items()},
        )
        self.config = OmegaConf.to_container(self._config, resolve=True)
        self.generation = 0
        self.procs: dict[str, subprocess.Popen] = {}
        self.listening: dict[str, list[str]] = {}
        self.leaks: list[str] = []

    @property
    def urls(self) -> dict[str, str]:
        return {
            name: f"http://{self.addresses[host]}:{PORT_BASE + PORT_OFFSETS[name]}"
            for name, host in self.host_of.items()
        }

    @property
    def process_groups(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items() if proc.poll() is None}

    def host_dir(self, host: str) -> Path:
        return self.work / "hosts" / f"{host}-{self.generation}"

    def _specs(self, host: str) -> list[ProcessSpec]:
        directory = self.host_dir(host)
        # The host's own copy of the config: Gym's results and cache on its own disk.
        config = OmegaConf.merge(
            self._config, {"results_dir": str(directory / "results"), "cache_dir": str(directory / "cache")}
        )
        gym = [name for name in PLACEMENT[host] if name != BACKEND]
        specs = gym_specs(config, OmegaConf.to_yaml(config), names=tuple(gym)) if gym else []
        if BACKEND in PLACEMENT[host]:
            address, port = self.addresses[host], PORT_BASE + PORT_OFFSETS[BACKEND]
            specs.insert(
                0,
                ProcessSpec(
                    BACKEND,
                    (
                        sys.executable,
                        "-m",
                        FAKE_BACKEND_MODULE,
                        "--host",
                        address,
                        "--port",
                        str(port),
                        "--model",
                        FAKE_MODEL_NAME,
                    ),
                    directory,
                    {},
                    f"http://{address}:{port}",
                    "/v1/models",
                ),
            )
        return specs

    def start(self, timeout: float = 180.0) -> None:
        """Fresh hosts: a new namespace and an empty directory each, then every server, until each answers."""
        self.generation += 1
        direct = ",".join([*self.addresses.values(), self.lan.hub_address, "127.0.0.1", "localhost"])
        specs = []
        for number, host in enumerate(PLACEMENT, 1):
            self.lan.add_host(host, number)
            directory = self.host_dir(host)
            for sub in ("logs", "tmp", "xdg-cache"):
                (directory / sub).mkdir(parents=True)
            for spec in self._specs(host):
                env = {
                    **os.environ,
                    **self.store_env,
                    **spec.env,
                    TOKEN_ENV: self.token,
                    "RAY_USAGE_STATS_ENABLED": "0",
                    "PYTHONUNBUFFERED": "1",
                    "NO_PROXY": direct,
                    "no_proxy": direct,
                    "TMPDIR": str(directory / "tmp"),
                    "XDG_CACHE_HOME": str(directory / "xdg-cache"),
                }
                with open(directory / "logs" / f"{spec.name}.log", "ab") as log:
                    self.procs[spec.name] = subprocess.Popen(
                        self.lan.argv(self.lan.hosts[host], spec.argv),
                        cwd=spec.cwd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                specs.append(spec)
        deadline = time.monotonic() + timeout
        for spec in specs:
            while not _responds(spec.url + spec.ready_path):
                if self.procs[spec.name].poll() is not None or time.monotonic() > deadline:
                    where = self.host_dir(self.host_of[spec.name]) / "logs"
                    raise RuntimeError(f"{spec.name} did not become ready (logs in {where})")
                time.sleep(0.1)  # wait-ok: poll interval of a bounded wait on the server answering
        for host, namespace in self.lan.hosts.items():
            self.listening[f"{host}-{self.generation}"] = _listening(self.lan, namespace)

    def kill(self) -> None:
        """Every host gone at once: its processes SIGKILLed, its namespace deleted, its disk wiped."""
        for host in list(self.lan.hosts):
            self.lan.remove_host(host)
        for host in PLACEMENT:
            logs = self.host_dir(host) / "logs"
            for log in sorted(logs.iterdir()) if logs.is_dir() else []:
                # The store's secret never reaches a server's output (read before the disk is wiped).
                if self.store_env["AWS_SECRET_ACCESS_KEY"] in log.read_text(errors="replace"):
                    self.leaks.append(f"{host}-{self.generation}/{log.name}")
            shutil.rmtree(self.host_dir(host), ignore_errors=True)
        for proc in self.procs.values():
            proc.wait(timeout=30)
        self.procs.clear()


def _responds(url: str) -> bool:
    try:
        with _DIRECT.open(url, timeout=1.0) as reply:
            return 200 <= reply.status < 300
    except OSError:
        return False


def _listening(lan: Lan, namespace: str) -> list[str]:
    """``address:port`` of every TCP socket listening in the host namespace (read through one of its pids)."""
    found: set[str] = set()
    for pid in lan.processes(namespace):
        try:
            with open(f"/proc/{pid}/net/tcp", encoding="ascii") as table:
                rows = table.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if state == "0A":
                address, port = local.split(":")
                octets = [str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)]
                found.add(f"{'.'.join(octets)}:{int(port, 16)}")
        break
    return sorted(found)


def main() -> int:
    tag, prefix, work, token = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    lan = Lan(tag, prefix, attach=True)
    server = LocalS3Server(host=lan.hub_address, log=work / "s3.log").start()
    try:
        server.apply()
        objstore.reset_filesystems()
        url = server.url("multihost", "ckpt")
        deployment = MultiHostDeployment(lan, work, token, server.env)
        deployment.start()
        result = asyncio.run(run_scenario(deployment, url, token, CONTINUED, RESTARTS, timeout=120))
        verify = subprocess.run(
            [sys.executable, "-m", "nemo_gym_checkpoint_plugin.cli", "verify", url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        prefix_path = objstore.ObjectPath(url).native
        objects = sorted(name[len(prefix_path) + 1 :] for name in objstore.filesystem("s3").find(prefix_path))
        deployment.kill()
        print(
            orjson.dumps(
                {
                    "result": dataclasses.asdict(result),
                    "verify": {"status": verify.returncode, "stdout": verify.stdout, "stderr": verify.stderr},
                    "listening": deployment.listening,
                    "addresses": deployment.addresses,
                    "objects": objects,
                    "hosts_left": sorted(os.listdir(work / "hosts")),
                    "leaks": deployment.leaks,
                }
            ).decode(),
            flush=True,
        )
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
