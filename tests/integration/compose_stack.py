"""The compose stack (docker/compose.yaml) run outside containers, from the compose file itself.

Each service runs the command and gets the environment that Compose resolves with an env file written by
docker/make-env.sh. Only what differs outside a container is replaced: the service hosts by the loopback
servers standing in for them (postgres:5432 by a pgserver PostgreSQL on its socket, objectstore:9000 by moto's
S3 server, mlflow:5000 and prefect-server:4200 by the servers started here), 0.0.0.0 by 127.0.0.1, the ports by
free ones, and the image's folders by folders of the test.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode, urlsplit, urlunsplit

from tests.compose import COMPOSE_FILE, compose_variables, make_env, resolve
from tests.integration.stack import BIN, REPO, Processes

# a compose service's name as a host in a URL: what must not reach a process started outside the containers
COMPOSE_HOST = re.compile(r"//(?:[^/@]*@)?(postgres|objectstore|mlflow|prefect-server)[:/]")
IMAGE_DIR = "/opt/llmops"  # WORKDIR and LLMOPS_PROJECT_DIR of docker/Dockerfile and docker/Dockerfile.gpu


def compose_services(root: Path, repository: str) -> dict[str, dict]:
    """Every service (the gpu profile's too) as Compose resolves the file with a fresh docker/.env naming
    `repository` as the one the workers clone."""
    env_file = root / ".env"
    make_env(env_file, repository)
    environ = {name: value for name, value in os.environ.items() if not name.startswith("LLMOPS_")}
    return resolve(compose_variables(env_file, environ), ["gpu"])["services"]


def created_buckets(services: dict[str, dict]) -> list[str]:
    """The buckets the `buckets` service makes on the object store (its `mc mb store/...`)."""
    entrypoint = services["buckets"]["entrypoint"]
    made = re.search(r"mc mb ([^&]+)", entrypoint)
    assert made, f"no `mc mb` in the buckets service: {entrypoint}"
    return re.findall(r"store/([\w.-]+)", made.group(1))


def start_postgres(root: Path, service: dict):
    """The postgres service on pgserver: its user (a superuser) with its password, its database, the init scripts
    it mounts into /docker-entrypoint-initdb.d run by psql as that user; every user but pgserver's own then logs in
    with a password, as in the image."""
    import pgserver

    env = service["environment"]
    user, password, database = env["POSTGRES_USER"], env["POSTGRES_PASSWORD"], env["POSTGRES_DB"]
    server = pgserver.get_server(root / "pg", cleanup_mode="delete")
    server.psql(f"CREATE ROLE {user} LOGIN SUPERUSER PASSWORD '{password}'; CREATE DATABASE {database} OWNER {user};")
    (root / "pg" / "pg_hba.conf").write_text("local all postgres trust\nlocal all all scram-sha-256\n")
    server.psql("SELECT pg_reload_conf();")
    url = postgres_url(f"postgresql://{user}:{password}@postgres:5432/{database}", server)
    for volume in service["volumes"]:
        source, _, target = volume.partition(":")
        if target.startswith("/docker-entrypoint-initdb.d/"):
            script = (COMPOSE_FILE.parent / source).resolve()
            pgserver.psql(["-v", "ON_ERROR_STOP=1", "-f", str(script), url])
    return server


def postgres_url(url: str, server) -> str:
    """A URL of the postgres service (any driver) pointed at pgserver's socket, user and password kept."""
    parts = urlsplit(url)
    assert (parts.hostname, parts.port) == ("postgres", 5432), url
    info = server.get_postmaster_info()
    query = urlencode({"host": str(info.socket_dir), "port": info.port})
    return urlunsplit((parts.scheme, f"{parts.username}:{parts.password}@", parts.path, query, ""))


@dataclass
class LoopbackStack:
    """The compose services with the servers that stand in for their hosts on loopback."""

    services: dict[str, dict]
    s3: str
    postgres: object  # the pgserver PostgresServer
    mlflow_port: int
    prefect_port: int

    @property
    def mlflow_url(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    @property
    def prefect_api(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}/api"

    def on_loopback(self, value: str) -> str:
        hosts = {"http://objectstore:9000": self.s3, "http://mlflow:5000": self.mlflow_url,
                 "http://prefect-server:4200": f"http://127.0.0.1:{self.prefect_port}"}
        for host, local in hosts.items():
            value = value.replace(host, local)
        if value.startswith("postgresql"):
            value = postgres_url(value, self.postgres)
        assert not COMPOSE_HOST.search(value), f"a compose host left in {value}"
        return value

    def environment(self, name: str) -> dict[str, str]:
        """A service's environment as compose gives it, its hosts on loopback."""
        return {key: self.on_loopback(str(value)) for key, value in self.services[name]["environment"].items()}

    def backend_store(self) -> str:
        """The MLflow server's --backend-store-uri, on loopback."""
        command = shlex.split(self.services["mlflow"]["command"])
        return self.on_loopback(command[command.index("--backend-store-uri") + 1])

    def artifacts_bucket(self) -> str:
        command = shlex.split(self.services["mlflow"]["command"])
        return urlsplit(command[command.index("--artifacts-destination") + 1]).netloc


def swapped(command: list[str], values: dict[str, str]) -> list[str]:
    """The command with the value after each of these options replaced; options it lacks are appended."""
    out = list(command)
    for option, value in values.items():
        if option in out:
            out[out.index(option) + 1] = value
        else:
            out += [option, value]
    return out


def start_mlflow_server(processes: Processes, stack: LoopbackStack, env: dict[str, str]) -> subprocess.Popen:
    command = shlex.split(stack.services["mlflow"]["command"])
    assert command[command.index("--host") + 1] == "0.0.0.0" and command[command.index("--port") + 1] == "5000"
    allowed = command[command.index("--allowed-hosts") + 1].replace(":5000", f":{stack.mlflow_port}")
    command = swapped(command, {"--host": "127.0.0.1", "--port": str(stack.mlflow_port),
                                "--backend-store-uri": stack.backend_store(), "--allowed-hosts": allowed})
    return processes.start("mlflow-server", [str(BIN / command[0]), *command[1:]],
                           {**env, **stack.environment("mlflow")})


def start_prefect_server(processes: Processes, stack: LoopbackStack, env: dict[str, str]) -> subprocess.Popen:
    """compose's command listens on the image's default port (4200): here a free one, named."""
    command = shlex.split(stack.services["prefect-server"]["command"])
    command = swapped(command, {"--host": "127.0.0.1", "--port": str(stack.prefect_port)})
    return processes.start("prefect-server", [str(BIN / command[0]), *command[1:]],
                           {**env, **stack.environment("prefect-server")})


def image_copy(project: Path, target: Path) -> Path:
    """What the images' `COPY . .` holds of a project: its files that .dockerignore lets through."""
    from docker.utils.build import exclude_paths

    patterns = [line for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for relative in exclude_paths(str(project), patterns):
        if (project / relative).is_file():
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(project / relative, target / relative)
    return target


def start_worker(processes: Processes, stack: LoopbackStack, pool: str, image: Path, home: Path,
                 env: dict[str, str]) -> subprocess.Popen:
    """A worker service: its entrypoint (docker/worker-start.sh, from the image copy) and command, in the image
    copy as its working directory, with compose's environment and the image's own (LLMOPS_PROJECT_DIR,
    LLMOPS_HOME: the copy and the worker's home here)."""
    service = stack.services[f"worker-{pool}"]
    entrypoint = [str(image / part.removeprefix(f"{IMAGE_DIR}/")) if part.startswith(IMAGE_DIR) else part
                  for part in service["entrypoint"]]
    command = shlex.split(service["command"])
    image_env = {"LLMOPS_PROJECT_DIR": str(image), "LLMOPS_HOME": str(home)}
    return processes.start(f"worker-{pool}", [*entrypoint, str(BIN / command[0]), *command[1:]],
                           {**env, **image_env, **stack.environment(f"worker-{pool}")}, cwd=image)


def start_model_service(processes: Processes, stack: LoopbackStack, port: int, home: Path,
                        env: dict[str, str]) -> subprocess.Popen:
    """The serve service: compose's command (listening beyond loopback, so its API key is required) on a free port,
    with compose's environment, its registry on loopback, and a home of its own."""
    command = shlex.split(stack.services["serve"]["command"])
    assert command[command.index("--host") + 1] == "0.0.0.0" and command[command.index("--port") + 1] == "8000"
    command = swapped(command, {"--port": str(port)})
    return processes.start("serve", [str(BIN / command[0]), *command[1:]],
                           {**env, **stack.environment("serve"), "LLMOPS_HOME": str(home)})
