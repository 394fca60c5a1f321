#!/usr/bin/env bash
# End-to-end test of `distro triage` and `distro retention` against real parts: a Docker engine,
# a local OCI registry (Debian docker-registry, deletes enabled) and real git.
#
# It pushes ten synthetic dated images (2026-03-01 .. 2026-03-10) of the fixture project in
# tests/fixtures/triage (no cargo build: the image content is the probe/ directory of a fixture
# upstream repository, built by `distro build` through `[[source_tree]]`), with a regression
# planted in a known upstream commit, then checks that triage finds the date and the commit,
# by exit code (over dates) and by a metric (between two given images, --good/--bad IMAGE),
# rebuilding at the failing image's own revision while the checkout's HEAD no longer builds,
# that a commit which does not build is skipped and reported, that an index lacking a platform
# of its definition is not pushed, and that retention deletes what it should and nothing a kept
# tag needs.
#
#   tests/e2e/triage.sh            # needs root (apt, dockerd)
#
# Environment: DISTRO_E2E_WORK (work dir, default target/e2e-triage), DISTRO_E2E_TRIAGE_PORT
# (registry port, default 5711).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${DISTRO_E2E_WORK:-$ROOT/target/e2e-triage}
PORT=${DISTRO_E2E_TRIAGE_PORT:-5711}
REG=127.0.0.1:$PORT
REPO=$REG/triage
mkdir -p "$WORK"
# shellcheck source=tests/e2e/lib/images-common.sh
source "$ROOT/tests/e2e/lib/images-common.sh"
[ "$(id -u)" = 0 ] || die "tests/e2e/triage.sh needs root: it installs Debian packages and starts dockerd"

T0=$(date +%s)
phase() { log "[$(($(date +%s) - T0))s] $*"; }
cleanup() {
    local rc=$?
    docker images --format '{{.Repository}}:{{.Tag}}' 2>/dev/null | grep -E "^($REPO|distro-triage):" | xargs -r docker rmi -f >/dev/null 2>&1 || true
    e2e_cleanup
    [ $rc = 0 ] && log "PASS: triage e2e in $(($(date +%s) - T0))s" || log "FAILED (rc=$rc); logs under $WORK"
}
trap cleanup EXIT


phase "setup: packages, dockerd, registry (deletes enabled)"
command -v dockerd >/dev/null || e2e_install docker.io
e2e_install skopeo umoci docker-registry busybox-static jq curl git
e2e_dockerd
rm -rf "$WORK/registry"
e2e_registry registry "$PORT"

phase "building distro"
cargo build --release --locked -p distro --manifest-path "$ROOT/Cargo.toml" >&2
DISTRO=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps | jq -r .target_directory)/release/distro
export DISTRO_CACHE_DIR="$WORK/sources-cache" DISTRO_TARGET_DIR="$WORK/distro-target"
rm -rf "$DISTRO_CACHE_DIR" "$DISTRO_TARGET_DIR"

phase "base: a busybox image (amd64) pushed to $REG/busybox"
# A static busybox stands in for the CUDA base: a single small layer, built in a second.
rm -rf "$WORK/base-root" "$WORK/base-oci"
mkdir -p "$WORK/base-root/bin" "$WORK/base-root/tmp"
cp "$(command -v busybox)" "$WORK/base-root/bin/busybox"
for a in $("$WORK/base-root/bin/busybox" --list); do
    [ "$a" = busybox ] || ln -s busybox "$WORK/base-root/bin/$a"
done
tar --numeric-owner --sort=name --mtime=@0 -C "$WORK/base-root" -cf "$WORK/base-root.tar" .
umoci init --layout "$WORK/base-oci" >&2
umoci new --image "$WORK/base-oci:latest" >&2
umoci raw add-layer --image "$WORK/base-oci:latest" "$WORK/base-root.tar" >&2
umoci config --image "$WORK/base-oci:latest" --architecture amd64 --os linux --config.env PATH=/bin --config.cmd /bin/sh >&2
skopeo copy -q "oci:$WORK/base-oci:latest" "docker://$REG/busybox:latest" --dest-tls-verify=false >&2
BASE_DIGEST=sha256:$(curl -sf -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$REG/v2/busybox/manifests/latest" | sha256sum | cut -d' ' -f1)
BASE="$REG/busybox:latest@$BASE_DIGEST"

phase "fixture upstream: a git repository with a planted regression"
# Commits (u0 .. u14), and the date each pins:
#   u0-u3   fine (loss 2.0)                     2026-03-01 .. 03-04 pin u0, u1, u2, u3
#   u4      loss 2.0 -> 2.6 (the metric regression; exit code still 0)
#   u5      fine
#   u6      moves probe/ away: the image does not build
#   u7      moves it back
#   u8      check.sh exits 1 (the exit-code regression)
#   u9-u14  fine                                2026-03-05 .. 03-10 pin u9 .. u14
UP="$WORK/upstream"
rm -rf "$UP"
git init -q -b main "$UP"
gc() { git -C "$UP" -c user.name=fixture -c user.email=fixture@example.invalid commit -q "$@"; }
mkdir -p "$UP/probe"
cat >"$UP/probe/check.sh" <<'EOF'
#!/bin/sh
# The fixture's test: reports the loss and exits with the status in ./status.
loss=$(cat /opt/probe/loss)
echo "probe: loss $loss, revision $(cat /opt/probe/revision)"
[ -n "$TRIAGE_OUT" ] && echo "{\"loss\": $loss}" >"$TRIAGE_OUT/metrics.json"
exit "$(cat /opt/probe/status)"
EOF
chmod +x "$UP/probe/check.sh"
echo 2.0 >"$UP/probe/loss"
echo 0 >"$UP/probe/status"
declare -a U
commit_rev() { # commit_rev N SUBJECT: records the revision file, commits, U[N]=id
    echo "$1" >"$UP/probe/revision"
    git -C "$UP" add -A
    gc -m "$2"
    U[$1]=$(git -C "$UP" rev-parse HEAD)
}
commit_rev 0 "probe: initial check"
for i in 1 2 3; do commit_rev "$i" "docs: note $i"; done
echo 2.6 >"$UP/probe/loss"; commit_rev 4 "model: new init scale (loss 2.0 -> 2.6)"
commit_rev 5 "docs: note 5"
git -C "$UP" mv probe tools; echo 6 >"$UP/tools/revision"; git -C "$UP" add -A; gc -m "layout: move probe/ to tools/"; U[6]=$(git -C "$UP" rev-parse HEAD)
git -C "$UP" mv tools probe; commit_rev 7 "layout: move tools/ back to probe/"
echo 1 >"$UP/probe/status"; commit_rev 8 "check: stricter tolerance"
for i in 9 10 11 12 13 14; do commit_rev "$i" "docs: note $i"; done

phase "ten dated images: bump the pin, lock, commit, build, push"
P="$WORK/project"
rm -rf "$P"
cp -r "$ROOT/tests/fixtures/triage/project" "$P"
git init -q -b main "$P"
pc() { git -C "$P" -c user.name=fixture -c user.email=fixture@example.invalid commit -q "$@"; }
PINS=(0 1 2 3 9 10 11 12 13 14)
B0=$(date +%s%N)
for d in $(seq 1 10); do
    DATE=$(printf '2026-03-%02d' "$d")
    sed -e "s|@UPSTREAM@|$UP|" -e "s|@COMMIT@|${U[${PINS[$((d - 1))]}]}|" "$P/images/manifest.toml.in" >"$P/images/manifest.toml"
    (cd "$P" && "$DISTRO" lock >"$WORK/lock-$DATE.log" 2>&1) || die "distro lock for $DATE failed: $(tail -3 "$WORK/lock-$DATE.log")"
    git -C "$P" add -A
    pc -m "nightly $DATE"
    (cd "$P" && "$DISTRO" build --image probe --base "$BASE" --date "$DATE" --push "$REPO" >"$WORK/build-$DATE.out" 2>"$WORK/build-$DATE.log") \
        || die "build $DATE failed: $(tail -5 "$WORK/build-$DATE.log")"
done
log "10 builds + pushes: $((($(date +%s%N) - B0) / 1000000)) ms"
# Image tags (10 dated, 10 per-arch, probe) and, as the distribution registry 2.8 has no
# referrers API, one referrers fallback tag per index (sha256-HEX: the SBOM and provenance).
img_tags() { curl -sf "http://$REG/v2/triage/tags/list" | jq -c '.tags | map(select(startswith("sha256-") | not)) | sort'; }
curl -sf "http://$REG/v2/triage/tags/list" | jq -e '(.tags | map(select(startswith("sha256-") | not)) | length == 21) and ([.tags[] | select(startswith("sha256-"))] | length == 10)' >/dev/null \
    || die "expected 21 image tags (10 dated, 10 per-arch, probe) and 10 referrers tags: $(curl -s "http://$REG/v2/triage/tags/list")"
docker run --rm "$REPO:probe-2026-03-01" >"$WORK/run-01.txt" 2>&1 || die "the first image does not pass: $(cat "$WORK/run-01.txt")"
grep -q "loss 2.0, revision 0" "$WORK/run-01.txt" || die "the image does not hold the pinned probe: $(cat "$WORK/run-01.txt")"

phase "provenance: distro verify passes on a fresh push, and names what was altered"
"$DISTRO" verify "$REPO:probe-2026-03-10" >"$WORK/verify.out" 2>"$WORK/verify.log" || die "distro verify failed: $(cat "$WORK/verify.out" "$WORK/verify.log")"
grep -q "^verified $REPO:probe-2026-03-10 (sha256:[0-9a-f]*): SBOM of 1 platform(s), 1 provenance statement(s), found through the tag sha256-" "$WORK/verify.out" \
    || die "distro verify did not say what it verified: $(cat "$WORK/verify.out")"
# Alter the provenance as a registry user could: a new statement whose revision is zeros, its
# artifact manifest, and the fallback tag's index pointing at it instead of the original.
tamper_provenance() {
    local idx fb prov st new_st loc sep new_m
    idx=sha256:$(curl -sf -H 'Accept: application/vnd.oci.image.index.v1+json' "http://$REG/v2/triage/manifests/$1" | sha256sum | cut -d' ' -f1)
    fb=${idx/:/-}
    curl -sf -H 'Accept: application/vnd.oci.image.index.v1+json' "http://$REG/v2/triage/manifests/$fb" >"$WORK/referrers.json"
    prov=$(jq -r '.manifests[] | select(.artifactType == "application/vnd.in-toto+json") | .digest' "$WORK/referrers.json")
    curl -sf -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$REG/v2/triage/manifests/$prov" >"$WORK/prov-manifest.json"
    st=$(jq -r '.layers[0].digest' "$WORK/prov-manifest.json")
    curl -sf "http://$REG/v2/triage/blobs/$st" \
        | jq -c '(.predicate.buildDefinition.resolvedDependencies[] | select(.name == "revision") | .digest.gitCommit) |= "0000000000000000000000000000000000000000"' \
        | tr -d '\n' >"$WORK/statement.json"
    new_st=sha256:$(sha256sum "$WORK/statement.json" | cut -d' ' -f1)
    loc=$(curl -sf -i -X POST "http://$REG/v2/triage/blobs/uploads/" | tr -d '\r' | sed -n 's/^[Ll]ocation: //p')
    case "$loc" in http*) ;; *) loc="http://$REG$loc" ;; esac
    sep='?'; case "$loc" in *\?*) sep='&' ;; esac
    curl -sf -X PUT -H 'Content-Type: application/octet-stream' --data-binary @"$WORK/statement.json" "$loc${sep}digest=$new_st" >/dev/null
    jq -c --arg d "$new_st" --argjson s "$(stat -c %s "$WORK/statement.json")" '.layers[0].digest = $d | .layers[0].size = $s' \
        "$WORK/prov-manifest.json" | tr -d '\n' >"$WORK/prov-manifest2.json"
    new_m=sha256:$(sha256sum "$WORK/prov-manifest2.json" | cut -d' ' -f1)
    curl -sf -X PUT -H 'Content-Type: application/vnd.oci.image.manifest.v1+json' --data-binary @"$WORK/prov-manifest2.json" \
        "http://$REG/v2/triage/manifests/$new_m" >/dev/null
    jq -c --arg old "$prov" --arg new "$new_m" --argjson s "$(stat -c %s "$WORK/prov-manifest2.json")" \
        '(.manifests[] | select(.digest == $old)) |= (.digest = $new | .size = $s)' "$WORK/referrers.json" | tr -d '\n' >"$WORK/referrers2.json"
    curl -sf -X PUT -H 'Content-Type: application/vnd.oci.image.index.v1+json' --data-binary @"$WORK/referrers2.json" \
        "http://$REG/v2/triage/manifests/$fb" >/dev/null
}
tamper_provenance probe-2026-03-10 || die "could not alter the provenance in the registry"
rc=0
"$DISTRO" verify "$REPO:probe-2026-03-10" >"$WORK/verify2.out" 2>"$WORK/verify2.log" || rc=$?
REV10=$(git -C "$P" log --format=%H --grep '^nightly 2026-03-10$')
[ "$rc" = 1 ] && [ "$(cat "$WORK/verify2.out")" = "provenance: dependency revision is {\"gitCommit\":\"0000000000000000000000000000000000000000\"}; the image records {\"gitCommit\":\"$REV10\"}" ] \
    && grep -q "^error: .*: 1 mismatch(es) between the image and what is attached to it" "$WORK/verify2.log" \
    || die "distro verify did not name the altered revision (rc $rc): $(cat "$WORK/verify2.out" "$WORK/verify2.log")"

phase "bad input: one line, exit code 2"
(cd "$P" && expect_fail 2 "must be before" "$DISTRO" triage --repo "$REPO" --image probe --good 2026-03-05 --bad 2026-03-01 -- /opt/probe/check.sh)
(cd "$P" && expect_fail 2 "has no tag probe-2026-02-01" "$DISTRO" triage --repo "$REPO" --image probe --good 2026-02-01 --bad 2026-03-10 -- /opt/probe/check.sh)
(cd "$P" && AFTER_WORK=1 expect_fail 2 "the command passes" "$DISTRO" triage --repo "$REPO" --image probe --good 2026-03-01 --bad 2026-03-04 --dates-only -- /opt/probe/check.sh)
(cd "$P" && expect_fail 2 "YYYY-MM-DD" "$DISTRO" retention --repo "$REPO" --image probe --keep-days 3 --today 2026-03-32)

phase "the checkout moves on: rebuilds must use each image's own revision, not HEAD"
# HEAD's definition no longer builds the probe (its tree is gone): a triage that rebuilt HEAD
# would skip every commit; one that rebuilds at the failing image's revision is unaffected.
sed -i 's|^src = "probe"$|src = "moved-away"|' "$P/images/probe.toml"
grep -q '^src = "moved-away"$' "$P/images/probe.toml" || die "could not change the checkout's definition"
git -C "$P" add -A && pc -m "HEAD: the probe tree moved (rebuilds at HEAD cannot build)"
REV05=$(git -C "$P" log --format=%H --grep '^nightly 2026-03-05$')
[ -n "$REV05" ] || die "no nightly 2026-03-05 commit in the fixture project"

phase "triage by exit code: 10 dates, then the upstream commits"
S=$(date +%s%N)
(cd "$P" && "$DISTRO" triage --repo "$REPO" --image probe --good 2026-03-01 --bad 2026-03-10 --gpus none --confirm 1 \
    --summary "$WORK/triage-exit.json" --work-dir "$WORK/triage-work" -- /opt/probe/check.sh \
    >"$WORK/triage-exit.out" 2>"$WORK/triage-exit.log") || die "triage failed: $(tail -5 "$WORK/triage-exit.log")"
log "triage (exit code): $((($(date +%s%N) - S) / 1000000)) ms, $(jq '.points | length' "$WORK/triage-exit.json") points"
cat "$WORK/triage-exit.out" >&2
grep -q "^culprit: date 2026-03-05 (last good 2026-03-04), source upstream, commit ${U[8]} \"check: stricter tolerance\"$" "$WORK/triage-exit.out" \
    || die "triage did not name 2026-03-05 and ${U[8]}: $(cat "$WORK/triage-exit.out")"
grep -q "^skipped (did not build): upstream@${U[6]:0:12}" "$WORK/triage-exit.out" || die "the commit that does not build was not reported"
jq -e --arg c "${U[8]}" --arg s "${U[6]:0:12}" --arg r "$REV05" '
    .culprit.date == "2026-03-05" and .culprit.commit == $c and .culprit.candidates == [$c]
    and .rebuilt_at == $r and .revisions.bad == $r
    and .last_good_date == "2026-03-04" and .first_bad_date == "2026-03-05"
    and ([.points[] | select(.kind == "commit" and .verdict == "skip") | .label] == ["upstream@" + $s])
    and ([.points[] | select(.kind == "date")] | length) <= 7
    and ([.points[] | select(.verdict == "fail") | .note | startswith("failed 2 time(s) (--confirm 1)")] | all)
    and all(.points[]; .run_seconds >= 0 and (.verdict | IN("pass", "fail", "skip")))' "$WORK/triage-exit.json" >/dev/null \
    || die "the summary is not as expected: $(cat "$WORK/triage-exit.json")"

phase "triage of two given images (--good IMAGE --bad IMAGE) by metric: loss above 2.5 fails"
(cd "$P" && expect_fail 2 "a date needs --repo" "$DISTRO" triage --good 2026-03-04 --bad "$REPO:probe-2026-03-05" -- /opt/probe/check.sh)
S=$(date +%s%N)
(cd "$P" && "$DISTRO" triage --good "$REPO:probe-2026-03-04" --bad "$REPO:probe-2026-03-05" --image probe --gpus none \
    --metric loss --threshold 2.5 --summary "$WORK/triage-metric.json" --work-dir "$WORK/triage-work" \
    -- /opt/probe/check.sh >"$WORK/triage-metric.out" 2>"$WORK/triage-metric.log") \
    || die "metric triage failed: $(tail -5 "$WORK/triage-metric.log")"
log "triage (two images, metric): $((($(date +%s%N) - S) / 1000000)) ms"
cat "$WORK/triage-metric.out" >&2
grep -q "^culprit: image $REPO:probe-2026-03-05 (good $REPO:probe-2026-03-04), source upstream, commit ${U[4]} " "$WORK/triage-metric.out" \
    || die "two-image triage did not name ${U[4]}: $(cat "$WORK/triage-metric.out")"
jq -e --arg r "$REV05" '([.points[] | select(.metric != null) | .metric] | (index(2) != null and index(2.6) != null))
    and ([.points[] | select(.kind == "image") | .verdict] == ["pass", "fail"]) and .rebuilt_at == $r' "$WORK/triage-metric.json" >/dev/null \
    || die "the summary does not record the two images, the metric values and the revision: $(cat "$WORK/triage-metric.json")"
# The checkout back to a definition that builds, for the phases below.
git -C "$P" -c user.name=fixture -c user.email=fixture@example.invalid revert --no-edit HEAD >/dev/null
grep -q '^src = "probe"$' "$P/images/probe.toml" || die "could not restore the checkout's definition"

phase "publishing: an index lacking a platform of its definition is refused"
PA="$WORK/project-arm64"
rm -rf "$PA" && cp -r "$P" "$PA"
sed -i 's|^platforms = .*|platforms = ["linux/amd64", "linux/arm64"]|' "$PA/images/probe.toml"
(cd "$PA" && "$DISTRO" build --image probe --base "$BASE" --date 2026-03-20 --platform linux/amd64 --output "$WORK/oci-amd64-only" \
    >/dev/null 2>"$WORK/amd64-only.log") || die "an amd64-only build to a layout failed: $(tail -3 "$WORK/amd64-only.log")"
expect_fail 2 "lacks linux/arm64/v8, a platform of its image definition" \
    "$DISTRO" push "$WORK/oci-amd64-only" "$REPO"
curl -sf "http://$REG/v2/triage/tags/list" | jq -e '.tags | index("probe-2026-03-20") == null' >/dev/null || die "the refused index was pushed"

phase "retention: keep 3 days and the first of the month"
(cd "$P" && "$DISTRO" retention --repo "$REPO" --image probe --keep-days 3 --today 2026-03-10 --dry-run >"$WORK/ret-dry.out" 2>&1) \
    || die "retention --dry-run failed: $(cat "$WORK/ret-dry.out")"
grep -c '^would delete' "$WORK/ret-dry.out" | grep -qx 10 || die "dry run should plan 10 deletions (5 dates x index + amd64): $(cat "$WORK/ret-dry.out")"
[ "$(img_tags | jq length)" = 21 ] || die "--dry-run deleted something"
"$DISTRO" retention --repo "$REPO" --image probe --keep-days 3 --today 2026-03-10 >"$WORK/ret.out" 2>&1 \
    || die "retention failed: $(cat "$WORK/ret.out")"
cat "$WORK/ret.out" >&2
TAGS=$(img_tags)
want='["probe","probe-2026-03-01","probe-2026-03-01-amd64","probe-2026-03-07","probe-2026-03-07-amd64","probe-2026-03-08","probe-2026-03-08-amd64","probe-2026-03-09","probe-2026-03-09-amd64","probe-2026-03-10","probe-2026-03-10-amd64"]'
[ "$TAGS" = "$want" ] || die "after retention the tags are $TAGS, not $want"
# Keep 0 days later on: 03-07 .. 03-09 go, 03-10 stays because the moving tag shares its index
# (and so does the platform manifest that index references).
"$DISTRO" retention --repo "$REPO" --image probe --keep-days 0 --today 2026-03-20 >"$WORK/ret2.out" 2>&1 \
    || die "retention failed: $(cat "$WORK/ret2.out")"
cat "$WORK/ret2.out" >&2
grep -q '^skip probe-2026-03-10 .*kept tag probe points at the same manifest' "$WORK/ret2.out" || die "retention did not refuse the digest the moving tag shares"
grep -q '^skip probe-2026-03-10-amd64 .*index references it' "$WORK/ret2.out" || die "retention did not keep the kept index's platform manifest"
TAGS=$(img_tags)
want='["probe","probe-2026-03-01","probe-2026-03-01-amd64","probe-2026-03-10","probe-2026-03-10-amd64"]'
[ "$TAGS" = "$want" ] || die "after the second retention the tags are $TAGS, not $want"
skopeo inspect --tls-verify=false "docker://$REPO:probe" >/dev/null || die "the moving tag no longer resolves"

phase "the base as a manifest source: bump moves the pin, the SBOM lists its dpkg packages"
# A copy of the project tracks the busybox base in its manifest ([bases.busybox]) and builds on it.
PB="$WORK/project-base"
rm -rf "$PB" && cp -r "$P" "$PB"
printf '\n[bases.busybox]\nimage = "%s"\ntag = "latest"\ndigest = "%s"\n' "$REG/busybox" "$BASE_DIGEST" >>"$PB/images/manifest.toml"
sed -i 's|^base = .*|base = { source = "busybox" }|' "$PB/images/probe.toml"
(cd "$PB" && DISTRO_TODAY=2026-03-11 "$DISTRO" lock >/dev/null 2>"$WORK/base-lock.log") || die "distro lock failed: $(cat "$WORK/base-lock.log")"
grep -q '^since = "2026-03-11"$' "$PB/images/manifest.lock" || die "the lock does not record the base's date: $(cat "$PB/images/manifest.lock")"
(cd "$PB" && "$DISTRO" bump --dry-run busybox >"$WORK/bump0.out" 2>&1) || die "bump of an unchanged base failed: $(cat "$WORK/bump0.out")"
grep -q "busybox. is at the tip" "$WORK/bump0.out" || die "an unchanged base should stay: $(cat "$WORK/bump0.out")"
git -C "$PB" add -A && git -C "$PB" -c user.name=fixture -c user.email=fixture@example.invalid commit -qm "track the base"
(cd "$PB" && "$DISTRO" build --image probe --date 2026-03-11 --output "$WORK/base-old" >/dev/null 2>"$WORK/base-old.log") \
    || die "build on the manifest's base failed: $(tail -3 "$WORK/base-old.log")"
# A new base under the same tag: busybox with a dpkg database and an os-release.
mkdir -p "$WORK/base-root/var/lib/dpkg" "$WORK/base-root/etc"
printf 'Package: libfixture1\nStatus: install ok installed\nArchitecture: amd64\nVersion: 1:1.2-3+b1\n\nPackage: base-files\nStatus: install ok installed\nArchitecture: amd64\nVersion: 13ubuntu10\n' \
    >"$WORK/base-root/var/lib/dpkg/status"
printf 'ID=ubuntu\nVERSION_ID="24.04"\n' >"$WORK/base-root/etc/os-release"
tar --numeric-owner --sort=name --mtime=@0 -C "$WORK/base-root" -cf "$WORK/base-root2.tar" .
umoci new --image "$WORK/base-oci:v2" >&2
umoci raw add-layer --image "$WORK/base-oci:v2" "$WORK/base-root2.tar" >&2
umoci config --image "$WORK/base-oci:v2" --architecture amd64 --os linux --config.env PATH=/bin --config.cmd /bin/sh >&2
skopeo copy -q "oci:$WORK/base-oci:v2" "docker://$REG/busybox:latest" --dest-tls-verify=false >&2
NEW_BASE=sha256:$(curl -sf -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$REG/v2/busybox/manifests/latest" | sha256sum | cut -d' ' -f1)
[ "$NEW_BASE" != "$BASE_DIGEST" ] || die "the new base has the old digest"
(cd "$PB" && DISTRO_TODAY=2026-03-12 "$DISTRO" bump busybox >"$WORK/bump.out" 2>"$WORK/bump.log") || die "distro bump failed: $(cat "$WORK/bump.log")"
[ "$(cat "$WORK/bump.out")" = "$(printf 'busybox\t%s -> %s' "$BASE_DIGEST" "$NEW_BASE")" ] || die "bump printed $(cat "$WORK/bump.out")"
grep -q "^digest = \"$NEW_BASE\"" "$PB/images/manifest.toml" || die "bump did not move the manifest's digest"
grep -q '^since = "2026-03-12"$' "$PB/images/manifest.lock" || die "bump did not date the new digest"
(cd "$PB" && DISTRO_TODAY=2026-03-15 "$DISTRO" sources >"$WORK/sources.out" 2>&1) || die "distro sources failed: $(cat "$WORK/sources.out")"
grep -q "^busybox .*current  2026-03-12  3 days$" "$WORK/sources.out" || die "distro sources does not show the base's age: $(cat "$WORK/sources.out")"
git -C "$PB" add -A && git -C "$PB" -c user.name=fixture -c user.email=fixture@example.invalid commit -qm "bump the base"
(cd "$PB" && "$DISTRO" build --image probe --date 2026-03-12 --output "$WORK/base-new" >/dev/null 2>"$WORK/base-new.log") \
    || die "build on the bumped base failed: $(tail -3 "$WORK/base-new.log")"
# The SBOM (/opt/distro/sbom.spdx.json in the image) lists the base's packages with package URLs.
found=""
for blob in "$WORK"/base-new/blobs/sha256/*; do
    if tar -xzOf "$blob" opt/distro/sbom.spdx.json >"$WORK/sbom.json" 2>/dev/null; then found=1; break; fi
done
[ -n "$found" ] || die "no layer of the new build holds /opt/distro/sbom.spdx.json"
jq -e '[.packages[] | select(.name == "libfixture1") | .externalRefs[0].referenceLocator] == ["pkg:deb/ubuntu/libfixture1@1%3A1.2-3%2Bb1?arch=amd64&distro=ubuntu-24.04"]' \
    "$WORK/sbom.json" >/dev/null || die "the SBOM does not list the base's dpkg package libfixture1 with its purl"
grep -q "^size linux/amd64: [0-9.]* MiB compressed, [0-9.]* MiB uncompressed$" "$WORK/base-new.log" \
    || die "the build did not report its size: $(cat "$WORK/base-new.log")"
# Over its budget, a build with --enforce-budget fails and writes nothing.
printf '\n[budget]\ncompressed_mib = 0\n' >>"$PB/images/probe.toml"
rc=0
(cd "$PB" && "$DISTRO" build --image probe --date 2026-03-13 --enforce-budget --output "$WORK/base-over" >/dev/null 2>"$WORK/over.log") || rc=$?
[ "$rc" = 1 ] && grep -q "^error: linux/amd64: [0-9.]* MiB compressed is over the budget of 0 MiB (.*probe.toml budget.compressed_mib)" "$WORK/over.log" \
    || die "an over-budget build was not refused (rc $rc): $(tail -2 "$WORK/over.log")"
[ ! -e "$WORK/base-over/index.json" ] || die "an over-budget build wrote its layout"

phase "distro diff: two layouts (the base moved), then two dated tags in the registry (the source moved)"
"$DISTRO" diff "$WORK/base-old" "$WORK/base-new" >"$WORK/diff.txt" 2>"$WORK/diff.log" || die "distro diff failed: $(cat "$WORK/diff.log")"
grep -qx "  ~ org.opencontainers.image.base.digest: $BASE_DIGEST -> $NEW_BASE" "$WORK/diff.txt" || die "diff does not show the base digest: $(cat "$WORK/diff.txt")"
grep -qx "  + linux/amd64 libfixture1 1:1.2-3+b1" "$WORK/diff.txt" || die "diff does not show the base's new package: $(cat "$WORK/diff.txt")"
grep -q "^  ~ linux/amd64 compressed: [0-9]* -> [0-9]*$" "$WORK/diff.txt" || die "diff does not show the size: $(cat "$WORK/diff.txt")"
grep -q "^  ~ \[bases.busybox\]: .*$BASE_DIGEST (since 2026-03-11) -> .*$NEW_BASE (since 2026-03-12)$" "$WORK/diff.txt" \
    || die "diff does not show the locked base: $(cat "$WORK/diff.txt")"
"$DISTRO" diff --json "$REPO:probe-2026-03-01" "$REPO:probe-2026-03-10" >"$WORK/diff.json" 2>"$WORK/diff.log" || die "distro diff of tags failed: $(cat "$WORK/diff.log")"
jq -e --arg a "${U[0]}" --arg b "${U[14]}" --arg up "$UP" \
    '.sources == [{"name": "upstream", "old": ("git " + $up + " " + $a), "new": ("git " + $up + " " + $b)}]' "$WORK/diff.json" >/dev/null || die "diff does not show the source's move: $(jq -c .sources "$WORK/diff.json")"
(cd "$P" && expect_fail 2 "neither an OCI layout directory nor an image reference" "$DISTRO" diff "$WORK/nowhere" "$WORK/base-new")

phase "done in $(($(date +%s) - T0))s"
