#!/bin/sh
# podman with the flags that work on the development machines, as root: vfs storage (no overlay mounts
# in their sandbox), runc (crun is refused), cgroupfs (no systemd), and scripts/containers.conf (no
# default ulimits). Use it like podman: scripts/podman.sh images, scripts/podman.sh run --network host ...
# PODMAN_FLAGS replaces the global flags for machines where podman's defaults work.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
command -v podman >/dev/null 2>&1 || {
    echo "$0: podman is not installed (apt-get install podman runc, or run scripts/build_image.sh)" >&2
    exit 127
}
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"
# shellcheck disable=SC2086 # PODMAN_FLAGS is a list of flags
exec podman ${PODMAN_FLAGS:---storage-driver vfs --cgroup-manager cgroupfs --runtime runc} "$@"
