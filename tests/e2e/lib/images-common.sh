# Shared helpers for the image end-to-end tests: installs what is missing, starts (and later
# stops) dockerd and two local registries, and builds a small multi-arch Debian base image that
# stands in for the CUDA base offline. Sourced by tests/e2e/images.sh and
# tests/e2e/manual/dockerfile.sh (this file lives outside tests/e2e/*.sh, which tests/run.sh runs).
#
# Everything it starts is recorded and stopped by e2e_cleanup; what it caches (debootstrap
# root filesystems) lives under $WORK/cache and is reused by later runs.

log() { printf '== %s\n' "$*" >&2; }
die() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

# expect_fail CODE PATTERN CMD...: CMD must exit with CODE and print PATTERN on stderr (in $WORK).
expect_fail() {
    local code=$1 pattern=$2 rc=0
    shift 2
    "$@" >"$WORK/out.txt" 2>"$WORK/err.txt" || rc=$?
    [ "$rc" = "$code" ] || die "expected exit $code from '$*', got $rc: $(tail -3 "$WORK/err.txt")"
    grep -q -- "$pattern" "$WORK/err.txt" || die "'$*' did not say '$pattern': $(cat "$WORK/err.txt")"
    # Bad input found before any work is the only line; after work (progress lines) the last.
    if [ "${AFTER_WORK:-0}" = 0 ]; then
        [ "$(grep -c . "$WORK/err.txt")" -le 1 ] || [ "$code" != 2 ] || die "bad input must be reported on one line: $(cat "$WORK/err.txt")"
    else
        [ "$(grep -c '^error:' "$WORK/err.txt")" = 1 ] && tail -1 "$WORK/err.txt" | grep -q "^error: .*$pattern" \
            || die "the error must be one line, the last: $(cat "$WORK/err.txt")"
    fi
}

E2E_PIDS=()
E2E_STARTED_DOCKERD=0

# e2e_install [PACKAGE...]: the Debian packages given (default: what images.sh needs, plus the
# arm64 Rust target).
e2e_install() {
    local pkgs=(docker.io skopeo umoci docker-registry debootstrap qemu-user-static binfmt-support
        apache2-utils gcc-aarch64-linux-gnu libc6-dev-arm64-cross jq curl git)
    local custom=$#
    ((custom)) && pkgs=("$@")
    local missing=()
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if ((${#missing[@]})); then
        log "installing ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y "${missing[@]}" >"$WORK/apt.log" 2>&1 \
            || { apt-get -o DPkg::Lock::Timeout=600 update >>"$WORK/apt.log" 2>&1 &&
                 DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y "${missing[@]}" >>"$WORK/apt.log" 2>&1; } \
            || die "apt-get install failed (see $WORK/apt.log)"
    fi
    ((custom)) || rustup target list --installed | grep -qx aarch64-unknown-linux-gnu || rustup target add aarch64-unknown-linux-gnu >&2
}

# arm64 binaries (debootstrap's second stage, docker run of the arm64 image) run under qemu.
e2e_binfmt() {
    if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc || die "cannot mount binfmt_misc"
    fi
    if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        update-binfmts --enable qemu-aarch64 >&2 || die "cannot register qemu-aarch64"
    fi
}

e2e_dockerd() {
    if docker info >/dev/null 2>&1; then return; fi
    log "starting dockerd"
    setsid dockerd >"$WORK/dockerd.log" 2>&1 &
    E2E_STARTED_DOCKERD=$!
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && return
        sleep 1
    done
    die "dockerd did not come up (see $WORK/dockerd.log)"
}

# e2e_registry NAME PORT [htpasswd-file]: a docker-registry on 127.0.0.1:PORT with its own
# config and storage under $WORK/NAME.
e2e_registry() {
    local name=$1 port=$2 htpasswd=${3:-}
    local dir="$WORK/$name"
    mkdir -p "$dir/storage"
    {
        echo "version: 0.1"
        echo "log: {level: warn}"
        echo "storage: {filesystem: {rootdirectory: $dir/storage}, delete: {enabled: true}}"
        echo "http: {addr: 127.0.0.1:$port, secret: e2e-$name}"
        if [ -n "$htpasswd" ]; then
            echo "auth: {htpasswd: {realm: e2e-$name, path: $htpasswd}}"
        fi
    } >"$dir/config.yml"
    setsid docker-registry serve "$dir/config.yml" >"$dir/registry.log" 2>&1 &
    E2E_PIDS+=($!)
    for _ in $(seq 1 50); do
        code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/v2/" || true)
        [ "$code" = 200 ] || [ "$code" = 401 ] && return
        sleep 0.2
    done
    die "registry $name did not come up (see $dir/registry.log)"
}

e2e_cleanup() {
    local pid
    for pid in "${E2E_PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    if [ "$E2E_STARTED_DOCKERD" != 0 ]; then
        kill "$E2E_STARTED_DOCKERD" 2>/dev/null || true
        for _ in $(seq 1 30); do kill -0 "$E2E_STARTED_DOCKERD" 2>/dev/null || break; sleep 0.5; done
    fi
}

# e2e_rootfs ARCH: a debootstrap --variant=minbase Debian bookworm, as a tar, cached.
e2e_rootfs() {
    local arch=$1
    local tarball="$WORK/cache/rootfs-bookworm-$arch.tar"
    if [ -s "$tarball" ]; then echo "$tarball"; return; fi
    mkdir -p "$WORK/cache"
    local dir="$WORK/cache/rootfs-$arch"
    rm -rf "$dir"
    log "debootstrap bookworm $arch (cached in $tarball for later runs)"
    debootstrap --variant=minbase --arch="$arch" bookworm "$dir" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
        >"$WORK/cache/debootstrap-$arch.log" 2>&1 || die "debootstrap $arch failed (see $WORK/cache/debootstrap-$arch.log)"
    # Drop what varies per run and has no place in an image.
    rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir"/var/log/* "$dir"/dev/* "$dir"/proc/* "$dir"/sys/*
    tar --numeric-owner --sort=name -C "$dir" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$dir"
    echo "$tarball"
}

# e2e_base REGISTRY REPO: pushes a two-platform Debian image to REGISTRY/REPO:bookworm (per-arch
# images built with umoci, copied with skopeo, joined by an OCI index).
e2e_base() {
    local registry=$1 repo=$2
    local layout="$WORK/base-oci"
    rm -rf "$layout"
    umoci init --layout "$layout" >&2
    local entries=() arch digest size
    for arch in amd64 arm64; do
        local rootfs
        rootfs=$(e2e_rootfs "$arch")
        umoci new --image "$layout:$arch" >&2
        umoci raw add-layer --image "$layout:$arch" "$rootfs" >&2
        umoci config --image "$layout:$arch" --architecture "$arch" --os linux \
            --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --config.cmd /bin/bash >&2
        skopeo copy -q "oci:$layout:$arch" "docker://$registry/$repo:bookworm-$arch" --dest-tls-verify=false >&2
        # Hash the stored bytes themselves ($(...) would drop a trailing newline).
        curl -sf -H 'Accept: application/vnd.oci.image.manifest.v1+json' -o "$WORK/base-manifest.json" \
            "http://$registry/v2/$repo/manifests/bookworm-$arch" || die "fetching the $arch base manifest failed"
        digest=sha256:$(sha256sum <"$WORK/base-manifest.json" | cut -d' ' -f1)
        size=$(wc -c <"$WORK/base-manifest.json")
        local variant=""
        [ "$arch" = arm64 ] && variant=',"variant":"v8"'
        entries+=("{\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"digest\":\"$digest\",\"size\":$size,\"platform\":{\"architecture\":\"$arch\",\"os\":\"linux\"$variant}}")
    done
    local index
    index="{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.index.v1+json\",\"manifests\":[$(IFS=,; echo "${entries[*]}")]}"
    curl -sf -X PUT -H 'Content-Type: application/vnd.oci.image.index.v1+json' --data-binary "$index" \
        "http://$registry/v2/$repo/manifests/bookworm" >&2 || die "pushing the base index failed"
    echo "sha256:$(printf '%s' "$index" | sha256sum | cut -d' ' -f1)"
}

# e2e_dashboard DISTRO HOST/REPO IMAGE OUT PLATFORM=SUMMARY... -- DATE...: attaches every
# summary.json to every dated index IMAGE-DATE of REPO (`distro attach-test`), checks `distro
# report`'s bad input, builds the site in OUT, checks it against the registry
# (tests/e2e/lib/dashboard_check.py: digests, sizes per layer group, test results, diff links)
# and loads index.html and the newest diff page in headless Chromium (installed when missing;
# screenshots in OUT/screenshots).
e2e_dashboard() {
    local distro=$1 repo=$2 image=$3 out=$4 lib specs=() s d
    lib=$(dirname "${BASH_SOURCE[0]}")
    shift 4
    while [ "$1" != -- ]; do specs+=("$1"); shift; done
    shift
    command -v chromium >/dev/null || e2e_install chromium
    for d in "$@"; do
        for s in "${specs[@]}"; do
            "$distro" attach-test "$repo:$image-$d" "${s#*=}" --platform "${s%%=*}" >>"$WORK/attach-test.log" 2>&1 \
                || die "distro attach-test $repo:$image-$d ${s#*=} failed: $(tail -3 "$WORK/attach-test.log")"
        done
    done
    expect_fail 2 "is not a date" "$distro" report --repo "$repo" --since 2026-02-30 --out "$out"
    expect_fail 2 "no dated tags $image-YYYY-MM-DD" "$distro" report --repo "$repo-nowhere" --out "$out"
    # Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
    AFTER_WORK=1 expect_fail 75 "cannot be reached" "$distro" report --repo 127.0.0.1:9/distro --out "$out"
    rm -rf "$out"
    "$distro" report --repo "$repo" --image "$image" --out "$out" >"$WORK/report.out" 2>"$WORK/report.log" \
        || die "distro report failed: $(tail -3 "$WORK/report.log")"
    python3 "$lib/dashboard_check.py" "$out" "$repo" "$image" "${specs[@]}" -- "$@" || die "the dashboard disagrees with the registry"
    # The check bites: the same page with every engine size set to 1 byte and every point of
    # the trends drawn 40 pixels lower fails it, naming both.
    mkdir -p "$WORK/site-bad"
    perl -pe 's/data-group="engine" data-bytes="\d+"/data-group="engine" data-bytes="1"/g;
        s/(<circle cx="\d+" cy=")(\d+)/$1.($2 + 40)/ge' "$out/index.html" >"$WORK/site-bad/index.html"
    if python3 "$lib/dashboard_check.py" "$WORK/site-bad" "$repo" "$image" -- "$1" >"$WORK/dashboard-bad.log"; then
        die "the dashboard check passed a page with wrong sizes and points"
    fi
    for fault in "engine shown as 1 bytes" "total $1: drawn at"; do
        grep -qF "$fault" "$WORK/dashboard-bad.log" || die "the dashboard check did not report '$fault': $(cat "$WORK/dashboard-bad.log")"
    done
    python3 "$lib/browser_check.py" "$out/screenshots" "$out/index.html" "$out/diff-${*: -1}.html" \
        || die "the dashboard's pages do not load cleanly in Chromium"
}

# e2e_signing DISTRO HOST REPO TAG_A TAG_B: `distro sign` and `distro verify --key` on two
# different indexes HOST/REPO:TAG_A and :TAG_B (neither signed yet), checked independently of
# distro: cosign's layout read back with curl (tag sha256-HEX.sig, one simple-signing layer, the
# signature annotation), the payload byte for byte, the signature verified by openssl; then a
# wrong key, a malformed key, a signature over another digest (A's copied onto B's tag), the
# referrer path alone, and a missing signature must each be refused on one line, exit 2.
e2e_signing() {
    local distro=$1 host=$2 repo=$3 a=$4 b=$5 dir="$WORK/signing" k da db sig_a layer out
    local index=application/vnd.oci.image.index.v1+json manifest=application/vnd.oci.image.manifest.v1+json
    rm -rf "$dir" && mkdir -p "$dir"
    for k in key other; do
        openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dir/$k.pem" 2>/dev/null
        openssl pkey -in "$dir/$k.pem" -pubout -out "$dir/$k.pub.pem"
    done
    da="sha256:$(curl -fsS -H "Accept: $index" "http://$host/v2/$repo/manifests/$a" | sha256sum | cut -d' ' -f1)"
    db="sha256:$(curl -fsS -H "Accept: $index" "http://$host/v2/$repo/manifests/$b" | sha256sum | cut -d' ' -f1)"
    [ "$da" != "$db" ] || die "e2e_signing needs two different indexes: $a and $b are both $da"
    sig_a="sha256-${da#sha256:}.sig"

    # Unsigned: verify as before without options; refused when a signature is asked for.
    "$distro" verify "$host/$repo:$a" >"$dir/verify0.out" 2>"$dir/verify0.log" || die "distro verify (unsigned, no options) failed: $(tail -3 "$dir/verify0.log")"
    expect_fail 2 "is not signed: no tag $sig_a" "$distro" verify "$host/$repo:$a" --require-signature
    expect_fail 2 "is not signed" "$distro" verify "$host/$repo:$a" --key "$dir/key.pub.pem"
    expect_fail 2 "not a PEM file" "$distro" sign "$host/$repo:$a" --key /etc/hostname
    expect_fail 2 "a public key" "$distro" sign "$host/$repo:$a" --key "$dir/key.pub.pem"

    "$distro" sign "$host/$repo:$a" --key "$dir/key.pem" >"$dir/sign.out" 2>"$dir/sign.log" || die "distro sign failed: $(tail -3 "$dir/sign.log")"
    grep -q "^signed $host/$repo:$a ($da) with .*tagged $sig_a" "$dir/sign.out" || die "distro sign said: $(cat "$dir/sign.out")"

    # cosign's layout, read with curl; the payload byte for byte; the signature checked by openssl.
    curl -fsS -H "Accept: $manifest" "http://$host/v2/$repo/manifests/$sig_a" >"$dir/sig-manifest.json" || die "no tag $sig_a after distro sign"
    jq -e --arg m "$manifest" '.schemaVersion == 2 and .mediaType == $m and (.layers | length) == 1
        and .layers[0].mediaType == "application/vnd.dev.cosign.simplesigning.v1+json"
        and (.layers[0].annotations["dev.cosignproject.cosign/signature"] | length) > 0
        and .config.mediaType == "application/vnd.oci.image.config.v1+json"' "$dir/sig-manifest.json" >/dev/null \
        || die "the signature manifest is not cosign's layout: $(cat "$dir/sig-manifest.json")"
    layer=$(jq -r '.layers[0].digest' "$dir/sig-manifest.json")
    curl -fsS "http://$host/v2/$repo/blobs/$layer" >"$dir/payload.json"
    [ "sha256:$(sha256sum <"$dir/payload.json" | cut -d' ' -f1)" = "$layer" ] || die "the payload blob does not match its digest"
    printf '{"critical":{"identity":{"docker-reference":"%s"},"image":{"docker-manifest-digest":"%s"},"type":"cosign container image signature"},"optional":null}' \
        "$host/$repo" "$da" | cmp -s - "$dir/payload.json" || die "the payload is not cosign's simple signing JSON: $(cat "$dir/payload.json")"
    jq -r '.layers[0].annotations["dev.cosignproject.cosign/signature"]' "$dir/sig-manifest.json" | base64 -d >"$dir/sig.der"
    openssl dgst -sha256 -verify "$dir/key.pub.pem" -signature "$dir/sig.der" "$dir/payload.json" >"$dir/openssl.out" 2>&1 \
        || die "openssl does not verify the signature: $(cat "$dir/openssl.out")"
    if openssl dgst -sha256 -verify "$dir/other.pub.pem" -signature "$dir/sig.der" "$dir/payload.json" >/dev/null 2>&1; then
        die "openssl verified the signature with another key"
    fi
    curl -fsS -H "Accept: $index" "http://$host/v2/$repo/manifests/sha256-${da#sha256:}" \
        | jq -e '.manifests[] | select(.artifactType == "application/vnd.dev.cosign.artifact.sig.v1+json")' >/dev/null \
        || die "the signature is not listed among the referrers of $da"

    "$distro" verify "$host/$repo:$a" --key "$dir/key.pub.pem" >"$dir/verify1.out" 2>"$dir/verify1.log" \
        || die "distro verify --key failed: $(tail -3 "$dir/verify1.log")"
    grep -q "^verified .*; signed with $dir/key.pub.pem (tag $sig_a)" "$dir/verify1.out" || die "distro verify --key said: $(cat "$dir/verify1.out")"
    "$distro" verify "$host/$repo@$da" --require-signature >"$dir/verify2.out" 2>&1 || die "distro verify --require-signature failed: $(cat "$dir/verify2.out")"
    out=$("$distro" sign "$host/$repo@$da" --key "$dir/key.pem" 2>&1) || die "distro sign (again) failed: $out"
    [[ $out == *"is already signed"* ]] || die "signing again was not a no-op: $out"

    expect_fail 2 "verifies with $dir/other.pub.pem" "$distro" verify "$host/$repo:$a" --key "$dir/other.pub.pem"
    expect_fail 2 "must be P-256" "$distro" verify "$host/$repo:$a" --key <(printf -- '-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n')
    expect_fail 2 "not a PEM file" "$distro" verify "$host/$repo:$a" --key /etc/hostname

    # A's signature under B's tag: the key's, but over another digest.
    curl -fsS -X PUT -H "Content-Type: $manifest" --data-binary @"$dir/sig-manifest.json" \
        "http://$host/v2/$repo/manifests/sha256-${db#sha256:}.sig" >/dev/null || die "cannot copy the signature onto $b's tag"
    expect_fail 2 "over another digest: its payload names $da" "$distro" verify "$host/$repo:$b" --key "$dir/key.pub.pem"

    # The referrer alone: A's cosign tag moved onto a manifest without signatures (the index).
    curl -fsS -H "Accept: $index" "http://$host/v2/$repo/manifests/$a" >"$dir/index.json"
    curl -fsS -X PUT -H "Content-Type: $index" --data-binary @"$dir/index.json" "http://$host/v2/$repo/manifests/$sig_a" >/dev/null
    "$distro" verify "$host/$repo:$a" --key "$dir/key.pub.pem" >"$dir/verify3.out" 2>"$dir/verify3.log" \
        || die "distro verify --key through the referrer failed: $(tail -3 "$dir/verify3.log")"
    grep -q "; signed with $dir/key.pub.pem (referrer sha256:" "$dir/verify3.out" || die "distro verify did not find the referrer: $(cat "$dir/verify3.out")"
    curl -fsS -X PUT -H "Content-Type: $manifest" --data-binary @"$dir/sig-manifest.json" "http://$host/v2/$repo/manifests/$sig_a" >/dev/null
    log "signing: $(cat "$dir/sign.out"); openssl: $(cat "$dir/openssl.out")"
}
