#!/bin/sh
# Entry point of the worker containers: bring the data that data.dvc pins from the team's DVC remote on S3
# (LLMOPS_DVC_REMOTE, at AWS_ENDPOINT_URL), then run the given command (the Prefect worker).
# The image holds no .git (see .dockerignore): DVC runs without git, with its cache in the workspace volume.
set -eu
cd "${LLMOPS_PROJECT_DIR:-/opt/llmops}"
if [ -n "${LLMOPS_DVC_REMOTE:-}" ]; then
  # .dvc/config.local: this machine's settings, over the committed .dvc/config
  {
    printf '[core]\n    no_scm = true\n    remote = team\n'
    printf '[cache]\n    dir = %s\n' "${LLMOPS_HOME:-/var/lib/llmops}/dvc/cache"
    printf '['"'"'remote "team"'"'"']\n    url = %s\n' "$LLMOPS_DVC_REMOTE"
    if [ -n "${AWS_ENDPOINT_URL:-}" ]; then printf '    endpointurl = %s\n' "$AWS_ENDPOINT_URL"; fi
  } > .dvc/config.local
  # a remote without the pinned version yet (a new team setup) must not keep the worker down: the flow's
  # ingest stage says clearly what is missing, and the deployments pull again before each run
  if ! dvc pull; then
    echo "worker-start: dvc pull from $LLMOPS_DVC_REMOTE failed; starting without the pinned data" >&2
  fi
fi
exec "$@"
