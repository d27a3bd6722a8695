#!/usr/bin/env bash
# Build honing's container image for real and check it works: `honing doctor` on the demo
# config, the demo for 20 steps, `honing serve verifier` scoring a batch (math and code, the
# code in the image's bubblewrap sandbox), deploy/compose.yaml's topology on loopback (a
# trainer on a rollout server and two verifiers), and the image's size. Writes
# benchmarks/results/image.md. Takes a few minutes; not part of `make test`.
#
#   sudo benchmarks/image_check.sh            (root: debootstrap, podman and mounts need it)
#
# The base image is a Debian bookworm rootfs made with debootstrap (cached in $BASE_DIR, so a
# rerun skips it) and imported into podman, so no container registry is needed. The image is
# built with `podman build --isolation chroot` from the repository's Containerfile. It is run
# without an OCI runtime: the image's filesystem (`podman image mount`) becomes the root of a
# bubblewrap sandbox, as the image's user (uid 1000), with its environment, /runs and /cache
# bound to writable host directories, / read-only, and the host's network (loopback).
#
# Settings (environment):
#   BASE_DIR      debootstrap cache (default /var/tmp/honing-image-base)
#   WORK_DIR      run and cache directories of the checks (default /var/tmp/honing-image-check)
#   MIRROR        Debian mirror (default: the first deb.debian.org-style URI apt uses)
#   WHEELS        local wheel directory for pip (default /opt/wheels, if present)
#   TORCH         torch requirement (default torch==2.13.0+cpu when WHEELS has that wheel)
#   BUILD_CACHE   1: reuse podman's layer cache (default 0: a full build, timed)
#   STEPS         demo steps (default 20)
#   KEEP_CACHE    1: keep the builtin:tiny built by an earlier run (default 0: build it again)
set -euo pipefail

ROOT_DIR=$(cd "$(dirname "$0")/.." && pwd)
BASE_DIR=${BASE_DIR:-/var/tmp/honing-image-base}
WORK_DIR=${WORK_DIR:-/var/tmp/honing-image-check}
WHEELS=${WHEELS:-/opt/wheels}
BUILD_CACHE=${BUILD_CACHE:-0}
STEPS=${STEPS:-20}
BASE_IMAGE=localhost/honing-base:bookworm
IMAGE=localhost/honing:cpu
IMAGE_UID=1000
VERIFIER_PORT=18080
RESULTS=$ROOT_DIR/benchmarks/results/image.md

say() { printf '== %s\n' "$*" >&2; }

default_mirror() {
    grep -rhoE '(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
        /etc/apt/sources.list.d/ 2>/dev/null | awk '{print $2; exit}'
}

build_base() {
    local rootfs=$BASE_DIR/rootfs mirror=${MIRROR:-$(default_mirror)}
    if [ ! -e "$BASE_DIR/rootfs.done" ]; then
        say "debootstrap bookworm from ${mirror:-http://deb.debian.org/debian} into $rootfs"
        rm -rf "$rootfs"
        mkdir -p "$BASE_DIR"
        debootstrap --variant=minbase \
            --include=python3,python3-venv,python3-pip,ca-certificates,bubblewrap \
            bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >"$BASE_DIR/debootstrap.log"
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        touch "$BASE_DIR/rootfs.done"
    fi
    # imported again after a new debootstrap (the stamp is older than rootfs.done)
    if ! podman image exists "$BASE_IMAGE" || [ "$BASE_DIR/rootfs.done" -nt "$BASE_DIR/imported" ]
    then
        say "podman import $rootfs as $BASE_IMAGE"
        tar -C "$rootfs" -c . | podman import - "$BASE_IMAGE" >/dev/null
        touch "$BASE_DIR/imported"
    fi
}

build_image() {
    local args="--isolation chroot" pip_options="" torch=${TORCH:-}
    local make_vars=(CONTAINER=podman "IMAGE=$IMAGE" "IMAGE_BASE=$BASE_IMAGE")
    # Local wheels and this host's CA bundle (pip's HTTPS may pass a TLS-inspecting proxy)
    # are mounted for the build only; neither stays in the image.
    if [ -d "$WHEELS" ]; then
        args+=" --volume $WHEELS:/tmp/wheels:ro"
        pip_options+=" --find-links /tmp/wheels"
        if [ -z "$torch" ] && compgen -G "$WHEELS/torch-2.13.0+cpu-*.whl" >/dev/null; then
            torch=torch==2.13.0+cpu
        fi
    fi
    if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
        args+=" --volume /etc/ssl/certs/ca-certificates.crt:/tmp/host-ca.crt:ro"
        pip_options+=" --cert /tmp/host-ca.crt"
    fi
    [ -z "$pip_options" ] || args+=" --build-arg 'PIP_OPTIONS=${pip_options# }'"
    # a local wheel: no torch index
    [ -z "$torch" ] || make_vars+=("IMAGE_TORCH=$torch" IMAGE_TORCH_INDEX=)
    [ "$BUILD_CACHE" = 1 ] || args+=" --no-cache"
    say "make image: $IMAGE on $BASE_IMAGE (${torch:-torch from the CPU index})"
    local start=$SECONDS
    make -C "$ROOT_DIR" image "${make_vars[@]}" "IMAGE_ARGS=$args" >"$WORK_DIR/build.log" 2>&1 \
        || { tail -30 "$WORK_DIR/build.log" >&2; exit 1; }
    BUILD_S=$((SECONDS - start))
    BUILD_TORCH=${torch:-torch==2.13.0 (CPU index)}
}

# in_image CMD...: run CMD in the image's filesystem under bubblewrap, as the image's user.
in_image() {
    local env=() line
    while IFS= read -r line; do
        env+=(--setenv "${line%%=*}" "${line#*=}")
    done < <(podman image inspect "$IMAGE" --format '{{range .Config.Env}}{{println .}}{{end}}' |
        sed '/^$/d')
    # The image's storage is root-only; a bind mount in a private mount namespace gives the
    # unprivileged user a path to it.
    unshare --mount --propagation private -- sh -c '
        root=$1; shift
        mount --bind "$root" "$0/root" && exec "$@"' "$WORK_DIR" "$IMAGE_ROOT" \
        setpriv --reuid="$IMAGE_UID" --regid="$IMAGE_UID" --clear-groups \
        bwrap --unshare-user --uid "$IMAGE_UID" --gid "$IMAGE_UID" \
        --unshare-pid --unshare-ipc --unshare-uts --die-with-parent \
        --ro-bind "$WORK_DIR/root" / --proc /proc --dev /dev --tmpfs /tmp --tmpfs /dev/shm \
        --tmpfs /home/honing --bind "$WORK_DIR/runs" /runs --bind "$WORK_DIR/cache" /cache \
        --chdir /runs --clearenv --setenv HOME /home/honing "${env[@]}" "$@"
}

check_doctor() {
    say "honing doctor on the demo config (builds builtin:tiny into /cache the first time)"
    local start=$SECONDS
    in_image honing doctor /opt/honing/examples/arithmetic.yaml >"$WORK_DIR/doctor.log" 2>&1 \
        && DOCTOR_RC=0 || DOCTOR_RC=$?
    DOCTOR_S=$((SECONDS - start))
    DOCTOR=$(grep -E 'checks passed' "$WORK_DIR/doctor.log" | tail -1)
    MODEL_S=$(grep -E '^ok +model' "$WORK_DIR/doctor.log" | grep -oE '\([0-9.]+ s\)$' | tr -d '()')
    cat "$WORK_DIR/doctor.log" >&2
}

check_demo() {
    say "the demo for $STEPS steps"
    rm -rf "$WORK_DIR/runs/demo"
    local start=$SECONDS
    in_image honing train /opt/honing/examples/arithmetic.yaml "trainer.total_steps=$STEPS" \
        --output-dir /runs/demo --resume never >"$WORK_DIR/demo.log" 2>&1 \
        && DEMO_RC=0 || DEMO_RC=$?
    DEMO_S=$((SECONDS - start))
    DEMO=$(grep -E '^val/accuracy:' "$WORK_DIR/demo.log" | tail -1)
    DEMO_PASS=$(grep -E '^val/pass@' "$WORK_DIR/demo.log" | tail -1)
    tail -4 "$WORK_DIR/demo.log" >&2
}

check_verifier() {
    say "honing serve verifier in the image, scoring a batch"
    cat >"$WORK_DIR/runs/verifier_check.py" <<'PY'
"""POST one batch of math and code items to the verifier; print its answer as JSON."""
import json
import sys

import httpx

program = "```python\nprint(int(input()) * 2)\n```"
items = [
    {"data_source": "lighteval/MATH", "response": r"so $\boxed{\dfrac{1}{2}}$", "ground_truth": "0.5"},
    {"data_source": "math", "response": "The answer is 3", "ground_truth": r"\frac{6}{3}"},
    {"data_source": "code", "response": program, "ground_truth": {"tests": [{"stdin": "4\n", "stdout": "8\n"}]}},
    {"data_source": "code", "response": program, "ground_truth": {"tests": [{"stdin": "4\n", "stdout": "9\n"}]}},
]
url = sys.argv[1]
health = httpx.get(f"{url}/health", timeout=10).json()
answer = httpx.post(f"{url}/score", json={"items": items}, timeout=60).json()
print(json.dumps({"health": health, "results": answer["results"]}))
PY
    in_image bash -c '
        honing serve verifier --host 127.0.0.1 --port "$1" --workers 2 2>/runs/verifier.log &
        server=$!
        healthy=0
        for _ in $(seq 60); do
            if python /opt/honing/healthcheck.py 2>/dev/null; then healthy=1; break; fi
            sleep 1
        done
        echo "healthcheck=$healthy" >&2
        python /runs/verifier_check.py "http://127.0.0.1:$1" >/runs/verifier.json
        status=$?
        kill "$server"; wait "$server"
        exit $status' _ "$VERIFIER_PORT" 2>"$WORK_DIR/verifier_check.log" \
        && VERIFIER_RC=0 || VERIFIER_RC=$?
    HEALTHCHECK=$(grep -o 'healthcheck=[01]' "$WORK_DIR/verifier_check.log" | tail -1)
    VERIFIER=$(python3 - "$WORK_DIR/runs/verifier.json" <<'PY'
import json
import sys

try:
    answer = json.load(open(sys.argv[1]))
except (OSError, ValueError) as err:
    print(f"no answer ({err})")
    sys.exit()
results = answer["results"]
scores = [r["score"] for r in results]
verdicts = [r["details"].get("verdict") for r in results]
isolation = sorted({r["details"]["isolation"] for r in results if "isolation" in r["details"]})
print(f"scores {scores}, verdicts {verdicts}, code run under {isolation}")
PY
)
    cat "$WORK_DIR/verifier_check.log" >&2
}

check_topology() {
    say "deploy/compose.yaml's topology on loopback: 2 verifiers, a rollout server, a trainer"
    rm -rf "$WORK_DIR/runs/topology"
    local start=$SECONDS
    in_image bash -c '
        servers=()
        honing serve verifier --host 127.0.0.1 --port 18081 --workers 1 2>/runs/v1.log &
        servers+=($!)
        honing serve verifier --host 127.0.0.1 --port 18082 --workers 1 2>/runs/v2.log &
        servers+=($!)
        honing serve rollout --model builtin:tiny --host 127.0.0.1 --port 18000 2>/runs/r.log &
        servers+=($!)
        python - <<PY || exit 1
import time, httpx
for port in (18081, 18082, 18000):
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        raise SystemExit(f"port {port}: no /health")
PY
        VERIFIER_ENDPOINT=http://127.0.0.1:18081,http://127.0.0.1:18082 MODEL_PATH=builtin:tiny \
            honing train /opt/honing/examples/arithmetic.yaml rollout.engine=openai \
            rollout.endpoints=http://127.0.0.1:18000 "trainer.total_steps=$1" \
            --output-dir /runs/topology --resume never
        status=$?
        python - <<PY
import re, httpx
for port in (18081, 18082):
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    codes = re.findall(r"honing_requests_total.*code=.200.. (\\d+)", text)
    print(f"served: verifier :{port} answered {sum(map(int, codes))} requests")
made = httpx.get("http://127.0.0.1:18000/health", timeout=5).json()["completions"]
print(f"served: rollout :18000 answered {made} completions")
PY
        kill "${servers[@]}"; wait "${servers[@]}"
        exit $status' _ "$STEPS" >"$WORK_DIR/topology.log" 2>&1 \
        && TOPOLOGY_RC=0 || TOPOLOGY_RC=$?
    TOPOLOGY_S=$((SECONDS - start))
    TOPOLOGY=$(grep -E '^val/accuracy:' "$WORK_DIR/topology.log" | tail -1)
    TOPOLOGY_SERVED=$(grep -E '^served:' "$WORK_DIR/topology.log" | sed 's/^served: //' | paste -sd ',' - | sed 's/,/, /g')
    TOPOLOGY_REQUESTS=$(python3 - "$WORK_DIR/runs/topology/metrics.jsonl" <<'PY'
import json
import sys

try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except (OSError, ValueError) as err:
    print(f"no metrics ({err})")
    sys.exit()
requests = sum(row.get("reward/requests", 0) for row in rows)
regenerated = sum(row.get("samples/regenerated", 0) for row in rows)
trained = {row["step"] for row in rows if row.get("step", 0) > 0 and "reward/requests" in row}
print(f"{len(trained)} steps trained, {requests:.0f} /score requests, {regenerated:.0f} regenerated")
PY
)
    tail -4 "$WORK_DIR/topology.log" >&2
}

write_results() {
    local size_bytes size_gb base_mb
    size_bytes=$(podman image inspect "$IMAGE" --format '{{.Size}}')
    size_gb=$(awk -v b="$size_bytes" 'BEGIN {printf "%.2f", b / 1e9}')
    base_mb=$(podman image inspect "$BASE_IMAGE" --format '{{.Size}}' | awk '{printf "%.0f", $1 / 1e6}')
    cat >"$RESULTS" <<EOF
# Container image: build and checks

Command: \`sudo benchmarks/image_check.sh\` ($(date -u +%Y-%m-%d)).

Machine: $(nproc) CPU threads, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), $(uname -sr), podman $(podman version --format '{{.Client.Version}}'), bubblewrap $(bwrap --version | awk '{print $2}'); 1-minute load average ${LOAD_START} at the start, $(cut -d' ' -f1 /proc/loadavg) at the end (the checks alone keep it near 2; above that, other processes shared the cores and the times are longer than on an idle machine). No container registry: the base image is a Debian bookworm rootfs from \`debootstrap --variant=minbase\` (python3, python3-venv, python3-pip, ca-certificates, bubblewrap; ${base_mb} MB) imported with \`podman import\`. The image is built from \`Containerfile\` by \`make image\` (\`podman build --format docker\`, here with \`--isolation chroot\`), torch from a local wheel (\`${BUILD_TORCH}\`), the rest from PyPI. It is run without an OCI runtime: the image's filesystem (\`podman image mount\`) is the root of a bubblewrap sandbox, read-only, as the image's user (uid ${IMAGE_UID}), with its environment and \`/runs\`, \`/cache\` bound to writable host directories.

| check | result |
|---|---|
| build (\`make image\`: \`podman build\` of \`Containerfile\`, no layer cache) | ${BUILD_S} s |
| image size (\`podman image inspect\`) | ${size_gb} GB (${size_bytes} bytes) |
| \`honing doctor examples/arithmetic.yaml\` | exit ${DOCTOR_RC}: ${DOCTOR:-no summary line}; ${DOCTOR_S} s (model check ${MODEL_S:-?}: loading builtin:tiny, built into an empty /cache unless KEEP_CACHE=1) |
| \`honing train examples/arithmetic.yaml trainer.total_steps=${STEPS}\` | exit ${DEMO_RC}, ${DEMO_S} s: ${DEMO:-no accuracy line}; ${DEMO_PASS:-} |
| \`honing serve verifier\`: \`HEALTHCHECK\` command | ${HEALTHCHECK:-not run} (1: \`GET /health\` answered) |
| \`honing serve verifier\`: one \`POST /score\` of 2 math + 2 code items | exit ${VERIFIER_RC}: ${VERIFIER} |
| compose topology on loopback: \`honing train ... rollout.engine=openai\` (${STEPS} steps) against \`honing serve rollout\` and two \`honing serve verifier\` | exit ${TOPOLOGY_RC}, ${TOPOLOGY_S} s: ${TOPOLOGY:-no accuracy line}; trainer's metrics: ${TOPOLOGY_REQUESTS}; the servers' own counters: ${TOPOLOGY_SERVED:-none} |

Expected verifier answer: scores [1.0, 0.0, 1.0, 0.0], verdicts correct, wrong, passed, failed.
EOF
    say "wrote $RESULTS"
    cat "$RESULTS" >&2
}

main() {
    [ "$(id -u)" = 0 ] || { echo "image_check.sh: run as root" >&2; exit 2; }
    mkdir -p "$WORK_DIR/runs" "$WORK_DIR/cache" "$WORK_DIR/root"
    # an empty /cache: the doctor check includes building builtin:tiny, as a first run does
    [ "${KEEP_CACHE:-0}" = 1 ] || rm -rf "${WORK_DIR:?}/cache"/*
    chown "$IMAGE_UID:$IMAGE_UID" "$WORK_DIR/runs" "$WORK_DIR/cache"
    LOAD_START=$(cut -d' ' -f1 /proc/loadavg)
    build_base
    build_image
    IMAGE_ROOT=$(podman image mount "$IMAGE")
    trap 'podman image unmount "$IMAGE" >/dev/null 2>&1 || true' EXIT
    check_doctor
    check_demo
    check_verifier
    check_topology
    write_results
    [ "$DOCTOR_RC" = 0 ] && [ "$DEMO_RC" = 0 ] && [ "$VERIFIER_RC" = 0 ] && [ "$TOPOLOGY_RC" = 0 ]
}

main "$@"
