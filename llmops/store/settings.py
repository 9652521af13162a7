"""Where runs, models and artifacts go: the config first, then the environment, then the embedded default.

The environment variables are the ones the libraries themselves read (`MLFLOW_TRACKING_URI`,
`MLFLOW_REGISTRY_URI`, `AWS_*`, `MLFLOW_S3_ENDPOINT_URL`), so one set of variables configures MLflow,
DVC's S3 remote and the artifact store alike. Anything printed goes through `mask` first.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlsplit

from llmops.config.schema import TrackingConfig
from llmops.store.workspace import home

# set for every run, in the CLI's process and in a worker's: MLflow writes a run's URL to stdout when the run
# ends, with the tracking URI's password in it
MLFLOW_DEFAULTS = {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}

MASK = "***"
# the value of a query parameter that carries a secret (?password=, ?X-Amz-Signature=, ?token=...)
SECRET_PARAMETER = re.compile(r"([?&][^=&#]*(?:pass|secret|token|signature|credential|key)[^=&#]*=)[^&#]*",
                              re.IGNORECASE)
LOCAL_SCHEMES = ("", "file", "sqlite")
# the user info of a URI (scheme://USER:PASSWORD@host), wherever it appears in a text
USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s]+)@")


def tracking_uri(config: TrackingConfig) -> str:
    """The config's tracking URI, else MLFLOW_TRACKING_URI, else a SQLite store in the workspace."""
    if config.tracking_uri:
        return config.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    folder = home() / "mlflow"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}"


def registry_uri(config: TrackingConfig) -> str:
    """The config's registry URI, else MLFLOW_REGISTRY_URI, else the tracking URI (MLflow's own rule)."""
    return config.registry_uri or os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri(config)


def resolved_stores(config: TrackingConfig) -> TrackingConfig:
    """The tracking section with its stores spelled out as this process resolves them, so that other processes
    (a service's replicas, on this machine or others) use the same ones."""
    return config.model_copy(update={"tracking_uri": tracking_uri(config), "registry_uri": registry_uri(config)})


def is_local_store(uri: str) -> bool:
    """A file or SQLite store on this machine (its artifacts belong in the workspace), not a server."""
    scheme = urlsplit(uri).scheme
    if uri.startswith("databricks"):  # MLflow's name for a Databricks workspace, not a folder
        return False
    return scheme in LOCAL_SCHEMES or len(scheme) == 1  # a Windows drive letter reads as a scheme


def mask(text: str | None) -> str:
    """Text fit to show: in every URI it holds, a password (or a bare user token) and secret query parameters
    become ***; the user name stays, to say who connects."""
    if text is None:
        return "none"
    return SECRET_PARAMETER.sub(rf"\1{MASK}", USERINFO.sub(masked_userinfo, text))


def masked_userinfo(found: re.Match[str]) -> str:
    user, has_password, _ = found.group("userinfo").partition(":")
    # a user with no password is often a token (https://TOKEN@host)
    return f"{found.group('scheme')}{user}:{MASK}@" if has_password else f"{found.group('scheme')}{MASK}@"


# the libraries behind fsspec's cloud stores: what they raise (no credentials, an endpoint that does not answer,
# access denied) is the store's answer, for the user to act on, not a fault of this code
STORE_LIBRARIES = frozenset({"botocore", "aiobotocore", "boto3", "s3fs", "gcsfs", "google", "adlfs", "azure",
                             "aiohttp"})


def store_library_error(err: BaseException) -> bool:
    return type(err).__module__.split(".")[0] in STORE_LIBRARIES


def store_refusal(setting: str, url: str, err: BaseException) -> str:
    """One line for a store that refused: the setting, its URL masked, the error, and what to check."""
    return (f"{setting} {mask(url)}: {type(err).__name__}: {' '.join(str(err).split())[:300]} (check the URL, that "
            "the bucket exists, the credentials and the endpoint, e.g. AWS_ENDPOINT_URL)")


def storage_options(url: str) -> dict[str, Any]:
    """fsspec options for an artifact store URL. S3 reads AWS_* itself (keys, region, AWS_ENDPOINT_URL);
    MLFLOW_S3_ENDPOINT_URL, which a team running MLflow on an S3-compatible store already sets, is the
    endpoint when no AWS endpoint variable is."""
    endpoint = os.environ.get("MLFLOW_S3_ENDPOINT_URL")
    aws_endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if urlsplit(url).scheme in ("s3", "s3a") and endpoint and not aws_endpoint:
        return {"client_kwargs": {"endpoint_url": endpoint}}
    return {}


def describe(config: TrackingConfig, remote: str | None) -> dict[str, str]:
    """What a run is about to use, masked, for the start-of-run line."""
    return {"MLflow tracking": mask(tracking_uri(config)), "MLflow registry": mask(registry_uri(config)),
            "artifact remote": mask(remote)}
