#!/bin/sh
# Write docker/.env (or the given path) from docker/.env.example: every empty value becomes a fresh random
# secret, readable by the owner only. An existing file is left as it is.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
target=${1:-$here/.env}
if [ -e "$target" ]; then
  echo "make-env: $target exists; not overwriting it" >&2
  exit 1
fi
# not a secret: the repository the workers clone
repo=${LLMOPS_GIT_REPO:-$(git -C "$here/.." remote get-url origin 2>/dev/null || true)}
secret() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
umask 077
while IFS= read -r line; do
  case "$line" in
    LLMOPS_PREFECT_AUTH=) echo "LLMOPS_PREFECT_AUTH=llmops:$(secret)" ;;
    LLMOPS_GIT_REPO=) echo "LLMOPS_GIT_REPO=$repo" ;;
    [A-Z]*=) echo "$line$(secret)" ;;
    *) echo "$line" ;;
  esac
done < "$here/.env.example" > "$target"
echo "make-env: wrote $target"
if [ -z "$repo" ]; then
  echo "make-env: this checkout has no origin remote: set LLMOPS_GIT_REPO in $target to the repository the workers clone" >&2
fi
