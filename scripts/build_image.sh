#!/bin/sh
# Builds the genscore CPU image with podman on a machine without a registry (`make image`):
#
#   1. installs podman, runc and debootstrap with apt-get when they are missing (root only);
#   2. builds the base image when it is missing: a minimal Debian rootfs (debootstrap, with python3
#      and python3-venv), imported with `podman import`;
#   3. writes the pip settings of this host into build/pip-host (its index URLs, its CA bundle and
#      the directory holding the local torch wheel), passed to the build as the `pip-host` context;
#   4. builds the image from the Dockerfile on that base.
#
#   scripts/build_image.sh [base]        `base`: stop after step 2
#
# Environment (defaults in brackets):
#   IMAGE          [localhost/genscore:0.1.0]          the image to build
#   BASE_IMAGE     [localhost/genscore-base:bookworm]  built by step 2 when no image has that name
#   DEBIAN_SUITE   [bookworm]  its python3 must be the one the torch wheel is built for (bookworm: 3.11)
#   DEBIAN_MIRROR  [http://deb.debian.org/debian]
#   WHEEL_DIR      [the directory of pip's find-links holding a torch wheel, if any]
#   BUILD_ARGS     []          more `podman build` flags, e.g. "--build-arg BAKE_WEIGHTS_CACHE=0", or
#                              "--layers" to keep a layer cache (on vfs storage every layer is a full
#                              copy of the filesystem: ~20 GB for this Dockerfile, ~10 GB more per rebuild)
# podman runs through scripts/podman.sh (the flags that work in the development sandbox).
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PODMAN="$ROOT/scripts/podman.sh"
IMAGE=${IMAGE:-localhost/genscore:0.1.0}
BASE_IMAGE=${BASE_IMAGE:-localhost/genscore-base:bookworm}
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PIP_HOST="$ROOT/build/pip-host"
PYTHON=${PYTHON:-python3}

say() { echo "build_image: $*" >&2; }
die() { say "$*"; exit 1; }

ensure_tools() {
    missing=""
    for tool in podman runc debootstrap; do
        command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"
    done
    [ -z "$missing" ] && return 0
    [ "$(id -u)" = 0 ] || die "missing:$missing; install them (apt-get install$missing) or run as root"
    command -v apt-get >/dev/null 2>&1 || die "missing:$missing, and no apt-get to install them with"
    say "installing$missing with apt-get"
    apt-get update -qq
    # shellcheck disable=SC2086 # one word per package
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing
}

# The torch wheel pip would take on this host: a find-links directory holding one, or WHEEL_DIR.
find_wheel_dir() {
    if [ -n "${WHEEL_DIR:-}" ]; then
        [ -d "$WHEEL_DIR" ] || die "WHEEL_DIR=$WHEEL_DIR is not a directory"
        echo "$WHEEL_DIR"
        return 0
    fi
    for dir in $(pip_setting find-links); do
        dir=${dir#file://}
        if ls "$dir"/torch-*.whl >/dev/null 2>&1; then
            echo "$dir"
            return 0
        fi
    done
}

# A pip setting of this host, as pip resolves it (environment, then config files); empty when unset.
pip_setting() {
    name=$1
    env_name=PIP_$(echo "$name" | tr 'a-z-' 'A-Z_')
    eval "value=\${$env_name:-}"
    # shellcheck disable=SC2154 # set by the eval
    if [ -n "$value" ]; then
        echo "$value"
        return 0
    fi
    for scope in global install; do
        value=$("$PYTHON" -m pip config get "$scope.$name" 2>/dev/null || true)
        if [ -n "$value" ]; then
            echo "$value"
            return 0
        fi
    done
}

# Fails with podman's own words when it cannot run here (a refused runtime, storage driver, ...).
check_podman() {
    if ! error=$("$PODMAN" info 2>&1 >/dev/null); then
        die "podman cannot run here: \`$PODMAN info\` failed: $error"
    fi
}

build_base() {
    if "$PODMAN" image exists "$BASE_IMAGE"; then
        say "base image $BASE_IMAGE exists"
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "debootstrap needs root to build $BASE_IMAGE"
    rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/genscore-rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' EXIT
    say "debootstrap $DEBIAN_SUITE into $rootfs (a few minutes)"
    # minbase: only the essential packages; passwd for the Dockerfile's groupadd/useradd.
    debootstrap --variant=minbase --include=python3,python3-venv,passwd \
        "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR" >"$rootfs.log" 2>&1 \
        || { tail -20 "$rootfs.log" >&2; die "debootstrap failed (log: $rootfs.log)"; }
    rm -f "$rootfs.log"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    chmod 755 "$rootfs"  # mktemp's 0700 would become the image's / and lock out the unprivileged user
    version=$(chroot "$rootfs" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    say "importing the rootfs (python $version) as $BASE_IMAGE"
    tar -C "$rootfs" -c . | "$PODMAN" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
}

# Checks that the base's python can install the local torch wheel (its cpXY tag).
check_python_matches_wheel() {
    wheel_dir=$1
    base_python=$("$PODMAN" run --rm --network host "$BASE_IMAGE" \
        python3 -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
    case "$base_python" in
    cp2* | cp3[0-9]) die "$BASE_IMAGE has Python $base_python; genscore needs >= 3.10" ;;
    esac
    if ! ls "$wheel_dir"/torch-*-"$base_python"-*.whl >/dev/null 2>&1; then
        die "$BASE_IMAGE has python $base_python, but $wheel_dir has no torch wheel for it: $(ls "$wheel_dir"/torch-*.whl)"
    fi
}

# build/pip-host: a pip.conf for the build with this host's indexes, CA bundle and wheel directory.
# Local (file://) indexes are mounted read-only at the same paths; prints those podman -v flags.
write_pip_host() {
    wheel_dir=$1
    rm -rf "$PIP_HOST"
    mkdir -p "$PIP_HOST"
    volumes=""
    {
        echo "# Written by scripts/build_image.sh from the build host's pip settings."
        echo "[global]"
        index_url=$(pip_setting index-url)
        extra=$(pip_setting extra-index-url)
        for url in $index_url $extra; do
            case "$url" in
            file://*)
                dir=${url#file://}
                dir=${dir%/}
                # The parent too: a simple index's pages link to files next to it (../../files/...).
                if [ -d "$dir" ]; then
                    volumes="$volumes -v $(dirname "$dir"):$(dirname "$dir"):ro"
                fi
                ;;
            esac
        done
        [ -z "$index_url" ] || echo "index-url = $index_url"
        [ -z "$extra" ] || echo "extra-index-url = $extra"
        cert=$(pip_setting cert)
        if [ -n "$cert" ] && [ -f "$cert" ]; then
            # An intercepting proxy's CA lives in the host's bundle only: pip in the build needs it too.
            cp "$cert" "$PIP_HOST/ca.crt"
            echo "cert = /pip-host/ca.crt"
        fi
        if [ -n "$wheel_dir" ]; then
            mkdir "$PIP_HOST/wheels"
            # Hard links when the wheel directory is on the same filesystem, else copies.
            cp -l "$wheel_dir"/torch-*.whl "$PIP_HOST/wheels/" 2>/dev/null || cp "$wheel_dir"/torch-*.whl "$PIP_HOST/wheels/"
            echo "find-links = /pip-host/wheels"
        fi
    } >"$PIP_HOST/pip.conf"
    echo "$volumes"
}

case "${1:-}" in
"" | base) ;;
*) echo "usage: $0 [base]" >&2; exit 2 ;;
esac
ensure_tools
check_podman
build_base
[ "${1:-}" = base ] && exit 0

wheel_dir=$(find_wheel_dir)
build_flags=""
if [ -n "$wheel_dir" ]; then
    check_python_matches_wheel "$wheel_dir"
    say "torch from the local wheel directory $wheel_dir"
    # Empty: torch comes from the index(es) of pip.conf, where the local wheel is the best match.
    build_flags="--build-arg TORCH_INDEX_URL="
fi
volumes=$(write_pip_host "$wheel_dir")
say "pip settings for the build: $PIP_HOST/pip.conf"
sed 's/^/    /' "$PIP_HOST/pip.conf" >&2

previous=$("$PODMAN" image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
started=$(date +%s)
# docker format: the OCI format has no HEALTHCHECK. No layer cache unless asked for (see BUILD_ARGS).
# shellcheck disable=SC2086 # flag lists
"$PODMAN" build --network host --layers=false --format docker \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-context pip-host="$PIP_HOST" \
    $build_flags $volumes ${BUILD_ARGS:-} \
    -t "$IMAGE" -f "$ROOT/Dockerfile" "$ROOT"
say "built $IMAGE in $(($(date +%s) - started)) s"
current=$("$PODMAN" image inspect --format '{{.Id}}' "$IMAGE")
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
    # The image this tag named before: ~2 GB that nothing refers to any more, unless a container does.
    "$PODMAN" rmi "$previous" >/dev/null 2>&1 || say "kept the previous $IMAGE ($previous): still in use"
fi
"$PODMAN" image inspect --format 'size: {{.Size}} bytes' "$IMAGE" >&2
