#!/usr/bin/env bash
# End-to-end test of recipes/launch/slurm.sbatch under a real Slurm: a two-node cluster on this
# machine (one slurmctld, `slurmd -N n1` and `slurmd -N n2` on 127.0.0.1), the template submitted
# in its bare-metal mode on the CPU, one task per "GPU" (2 nodes x 2 tasks: FSDP 2 in a node,
# data 2 across nodes), the way the issue's users submit it:
#
#   sbatch --nodes=2 --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 recipes/launch/slurm.sbatch ARGS
#
# It checks that
# - the job's loss curve (RUN_DIR/metrics.jsonl) is the curve of one process training the same
#   global batch, within 1e-5 relative;
# - a longer job with checkpoints, interrupted twice, ends on the uninterrupted curve: once by
#   `scontrol requeue` (Slurm SIGTERMs the ranks and requeues the job), once by the time limit's
#   warning to the batch script (what `--signal=B:USR1@300` sends; the script passes it on to the
#   ranks and requeues the job itself). Each start resumes through `engine train --resume=auto`.
#   Slurm holds a requeued job for about two minutes (its BeginTime); the test lets it start at
#   once (`scontrol update StartTime=now`).
# - a job with checkpoints whose ranks are killed three times with SIGKILL (a rank's process
#   chosen at random each time; the job fails and is requeued) ends on the uninterrupted curve,
#   and `engine goodput` of its run directory finds its 4 attempts and explains at least 95 % of
#   their summed wall time by cause (docs/launch.md, "Goodput"); the same job with the local tier
#   of checkpoints on (train.local_checkpoint_every = 2, docs/checkpoints.md) does too, and
#   computes fewer steps again than the job with the persistent tier alone.
#
#   tests/e2e/slurm.sh            # needs root (apt, /etc/hosts, the daemons)
#
# Installs slurm-wlm and munge when missing, adds `n1 n2` to /etc/hosts (once), starts munged when
# none answers, and stops every daemon it started on exit. Rerunning it stops what an earlier run
# left behind. Environment: ENGINE_E2E_SLURM_WORK (work dir, default target/e2e-slurm),
# ENGINE_E2E_SLURM_PORT (slurmctld's port; the slurmds take the next two). Without it the test
# takes the first three free consecutive TCP ports from 17000 (to 17999); with it, a port of the
# three that another process holds fails the test at once, naming the port and its holder.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${ENGINE_E2E_SLURM_WORK:-$ROOT/target/e2e-slurm}
PORT=${ENGINE_E2E_SLURM_PORT:-}
ENGINE=$ROOT/target/release/engine
TEMPLATE=$ROOT/recipes/launch/slurm.sbatch
export SLURM_CONF=$WORK/slurm.conf
NODES=(n1 n2)

T0=$(date +%s)
log() { printf '== [%ss] %s\n' "$(($(date +%s) - T0))" "$*" >&2; }
die() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "tests/e2e/slurm.sh needs root: it installs Debian packages, edits /etc/hosts and starts munged and Slurm"
mkdir -p "$WORK"

# --- ports -------------------------------------------------------------------------------------
# The daemons bind their ports on every address with SO_REUSEADDR; so does the probe, which tries
# each port (an earlier test's TIME-WAIT connections do not count, a listener on any address does).
PROBE='
import socket, sys
def free(p):
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", p))
        s.listen(1)
        return True
    except OSError:
        return False
    finally:
        s.close()
lo, hi, n = map(int, sys.argv[1:4])
for p in range(lo, hi + 1):
    if all(free(q) for q in range(p, p + n)):
        print(p)
        sys.exit(0)
sys.exit(3)
'

# probe FROM TO N: prints the first port P from FROM to TO with P .. P+N-1 free; fails when none
# is. Without python3, the ports that ss sees listening are the taken ones.
probe() {
    local rc=0
    if command -v python3 >/dev/null 2>&1; then
        python3 -c "$PROBE" "$@" 2>/dev/null || rc=$?
        if ((rc == 0 || rc == 3)); then return "$rc"; fi
    fi
    ss -Hltn | awk -v lo="$1" -v hi="$2" -v n="$3" '{ sub(/.*:/, "", $4); taken[$4] = 1 }
        END { for (p = lo; p <= hi; p++) { for (i = 0; i < n && !((p + i) in taken); i++); if (i == n) { print p; exit 0 } }
              exit 3 }'
}

# port_taken P: another process holds port P; sets HOLDER to who (from ss -ltnp: pid, command
# line, address). A daemon of this work dir's configuration (an earlier run's, stopped before
# the cluster starts) does not count.
port_taken() {
    local p=$1 line pid cmd who=
    probe "$p" "$p" 1 >/dev/null && return 1
    line=$(ss -Hltnp "sport = :$p" | head -1)
    [ -n "$line" ] || line=$(ss -Htanp "sport = :$p" | grep -v '^TIME-WAIT' | head -1 || true)
    for pid in $(grep -o 'pid=[0-9]*' <<<"$line" | cut -d= -f2 | sort -un); do
        cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || true
        [[ $cmd == *"$SLURM_CONF"* ]] && return 1
        cmd=${cmd% }
        ((${#cmd} <= 120)) || cmd="${cmd:0:117}..."
        who+="${who:+, }pid $pid ($cmd)"
    done
    if [ -n "$line" ]; then
        HOLDER="${who:-a process ss does not name}, $(awk '{print $1 " on " $4}' <<<"$line")"
    else
        HOLDER="a socket ss does not show (binding the port fails)"
    fi
}

# ROLE[i]: what port PORT+i is for.
ROLE=("slurmctld's port" "slurmd n1's port" "slurmd n2's port")
# check_ports: ENGINE_E2E_SLURM_PORT's three ports are free, or the test fails in one line.
check_ports() {
    local i
    for i in 0 1 2; do
        port_taken $((PORT + i)) || continue
        die "ENGINE_E2E_SLURM_PORT=$PORT: port $((PORT + i)) (${ROLE[$i]}) is taken by $HOLDER; free it, or unset ENGINE_E2E_SLURM_PORT to take free ports"
    done
}
if [ -n "$PORT" ]; then
    [[ $PORT =~ ^[0-9]+$ ]] && ((PORT >= 1 && PORT <= 65533)) \
        || die "ENGINE_E2E_SLURM_PORT=$PORT is not a port from 1 to 65533 (the slurmds take the next two)"
    check_ports # at once, before the packages and the build
fi

# The daemons this run started: stopped on exit, whatever happens.
STARTED_MUNGED=
cleanup() {
    local rc=$?
    trap - EXIT
    stop_cluster
    if [ -n "$STARTED_MUNGED" ]; then
        kill "$STARTED_MUNGED" 2>/dev/null || true
        rm -f "$WORK/munged.pid"
    fi
    if [ "$rc" = 0 ]; then log "PASS: slurm e2e in $(($(date +%s) - T0))s"; else log "FAILED (rc=$rc); logs under $WORK"; fi
    exit "$rc"
}
trap cleanup EXIT

# stop_cluster: the jobs, the daemons, and whatever a job of this work dir left running.
stop_cluster() {
    if [ -e "$SLURM_CONF" ] && [ -e "$WORK/slurmctld.pid" ] && timeout 5 scontrol ping >/dev/null 2>&1; then
        scancel --full --quiet 2>/dev/null || true
        for _ in $(seq 1 50); do
            [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    stop_daemons
    sweep
}

# sweep: kills the processes of jobs of this work dir that outlived their daemons (an earlier
# run killed before its cleanup): slurmstepd, the batch script, srun and the engine run in
# $WORK or name it.
sweep() {
    local p comm cwd pids=()
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" = $$ ] && continue
        comm=$(cat "/proc/$p/comm" 2>/dev/null) || continue
        case $comm in slurmstepd | slurm_script | srun | engine | bash) ;; *) continue ;; esac
        cwd=$(readlink "/proc/$p/cwd" 2>/dev/null) || true
        if [[ $cwd == "$WORK" || $cwd == "$WORK"/* ]] || tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -qF -- "$WORK/"; then
            running "$p" && kill -9 "$p" 2>/dev/null && pids+=("$p")
        fi
    done
    for p in ${pids[@]+"${pids[@]}"}; do
        for _ in $(seq 1 20); do
            running "$p" || break
            sleep 0.1
        done
    done
    return 0
}

# stop_daemons: slurmctld and the slurmds of this work dir (their pid files), waited for.
stop_daemons() {
    local f pid pids=()
    for f in "$WORK"/slurmd-n*.pid "$WORK/slurmctld.pid"; do
        [ -e "$f" ] || continue
        pid=$(cat "$f")
        # Only a daemon of this configuration: a reused pid is someone else's process.
        if [ -n "$pid" ] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$SLURM_CONF"; then
            kill "$pid" 2>/dev/null && pids+=("$pid")
        fi
        rm -f "$f"
    done
    for pid in ${pids[@]+"${pids[@]}"}; do
        for _ in $(seq 1 50); do
            running "$pid" || break
            sleep 0.1
        done
        running "$pid" && kill -9 "$pid" 2>/dev/null
    done
    return 0
}

# running PID: the process is there and not a zombie (an init that reaps nothing leaves those).
running() { [ -e "/proc/$1/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }

log "setup: packages, munge, /etc/hosts"
missing=()
for p in slurm-wlm munge; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    { apt-get -o DPkg::Lock::Timeout=600 update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${missing[@]}"; } \
        >"$WORK/apt.log" 2>&1 || die "apt-get install ${missing[*]} failed (see $WORK/apt.log)"
fi
if [ ! -x "$ENGINE" ]; then
    log "building the engine"
    cargo build --release --locked -p engine --manifest-path "$ROOT/Cargo.toml" >&2
fi

# munge: the key (the package makes one; a missing one is made here) and a munged that answers.
# A munged that an earlier run started and could not stop is this run's to stop.
if [ -s "$WORK/munged.pid" ] && running "$(cat "$WORK/munged.pid")" &&
    [ "$(cat "/proc/$(cat "$WORK/munged.pid")/comm" 2>/dev/null)" = munged ]; then
    STARTED_MUNGED=$(cat "$WORK/munged.pid")
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    if [ ! -s /etc/munge/munge.key ]; then
        mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
            || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge
    chown munge:munge /run/munge
    chmod 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/e2e-munged.pid
    for _ in $(seq 1 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    munge -n | unmunge >/dev/null || die "munged does not answer"
    STARTED_MUNGED=$(cat /run/munge/e2e-munged.pid)
    echo "$STARTED_MUNGED" >"$WORK/munged.pid"
fi

# n1 and n2 are names of this machine (the engine's rank 0 is the first host of the node list).
for n in "${NODES[@]}"; do
    # getent exits 2 for a name it does not know (a fresh machine): that is the case to handle.
    addr=$(getent hosts "$n" | awk '{print $1; exit}' || true)
    if [ -z "$addr" ]; then
        echo "127.0.0.1 $n" >>/etc/hosts
    elif [ "$addr" != 127.0.0.1 ]; then
        die "$n is $addr here, not this machine: the test needs the names n1 and n2 for 127.0.0.1"
    fi
done

# log_tail FILE: the end of a daemon's log, for a failure message.
log_tail() {
    if [ -s "$1" ]; then
        printf -- '--- the end of %s:\n' "$1"
        tail -n 15 "$1"
    else
        printf -- '--- %s: empty or missing\n' "$1"
    fi
}

# daemon_up NAME PORT LOG PIDFILE CMD...: starts a daemon (CMD, which daemonizes) and waits, 20 s
# at most, until it listens on PORT. Otherwise sets FAILED (why, with the end of its log) and
# FAILED_PORT, and fails.
daemon_up() {
    local name=$1 port=$2 logf=$3 pidfile=$4 pid= rc=0 why i cmdline
    shift 4
    cmdline=$(sed 's/[][\.*^$+?(){}|]/\\&/g' <<<"$*") # for pgrep, which takes a regex
    "$@" {LOCK}>&- || rc=$?
    if ((rc == 0)); then
        why="not listening on port $port after 20 s"
        for i in $(seq 1 100); do
            pid=$(cat "$pidfile" 2>/dev/null || true)
            # Gone: its pid file names no running process, or after a second there is no pid file
            # and no process with its command line (it failed before writing one).
            if { [ -n "$pid" ] && ! running "$pid"; } ||
                { [ -z "$pid" ] && ((i > 5)) && ! pgrep -x -f -- "$cmdline" >/dev/null; }; then
                why="it exited"
                break
            fi
            [ -n "$pid" ] && ss -Hltnp "sport = :$port" | grep -q "pid=$pid," && return 0
            sleep 0.2
        done
    else
        why="\`$*\` exited $rc"
    fi
    FAILED_PORT=$port
    if port_taken "$port"; then why+="; port $port is taken by $HOLDER"; fi
    FAILED="$name did not come up on port $port ($why)
$(log_tail "$logf")"
    return 1
}

# start_cluster: slurmctld, then the slurmds, each listening on its port.
start_cluster() {
    daemon_up slurmctld "$PORT" "$WORK/slurmctld.log" "$WORK/slurmctld.pid" slurmctld -f "$SLURM_CONF" || return 1
    local i=1 n
    for n in "${NODES[@]}"; do
        mkdir -p "$WORK/slurmd-$n"
        daemon_up "slurmd -N $n" $((PORT + i)) "$WORK/slurmd-$n.log" "$WORK/slurmd-$n.pid" \
            slurmd -f "$SLURM_CONF" -N "$n" || return 1
        i=$((i + 1))
    done
}

# cluster_logs: which daemons are not running, and the end of each one's log.
cluster_logs() {
    local d pid
    for d in slurmctld slurmd-n1 slurmd-n2; do
        pid=$(cat "$WORK/$d.pid" 2>/dev/null || true)
        if [ -z "$pid" ] || ! running "$pid"; then echo "--- $d is not running"; fi
        log_tail "$WORK/$d.log"
    done
}

# The ports. A lock makes concurrent runs of this test (with other work dirs) pick and bind their
# ports one after the other; the daemons do not inherit it. A port that another process takes
# between the probe and the daemon's bind (when the test picked the ports) makes the test pick
# again, twice at most.
exec {LOCK}>/tmp/engine-e2e-slurm-ports.lock
if command -v flock >/dev/null 2>&1; then
    flock -w 300 "$LOCK" || die "another run of tests/e2e/slurm.sh held /tmp/engine-e2e-slurm-ports.lock for 300 s"
fi
stop_cluster # what an earlier run left behind
FROM=17000
for try in 1 2 3; do
    if [ -n "${ENGINE_E2E_SLURM_PORT:-}" ]; then
        check_ports
        how="ENGINE_E2E_SLURM_PORT"
    else
        PORT=$(probe "$FROM" 17999 3) \
            || die "no three free consecutive TCP ports from $FROM to 17999 (ss -ltnp shows who holds them); set ENGINE_E2E_SLURM_PORT"
        how="the first three free consecutive ports from $FROM"
    fi
    log "a two-node Slurm cluster: slurmctld on port $PORT, slurmd n1 and n2 on $((PORT + 1)) and $((PORT + 2)) ($how)"
    rm -rf "$WORK/state" "$WORK"/slurmd-n* "$WORK"/runs "$WORK"/*.log
    mkdir -p "$WORK/state" "$WORK/runs"
    : >"$WORK/plugstack.conf" # no SPANK plugins (pyxis may be installed here)
    cat >"$SLURM_CONF" <<EOF
ClusterName=engine-e2e
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/slurmd-%n
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd-%n.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd-%n.log
PlugStackConfig=$WORK/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=30
NodeName=n1 NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=2 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=2 State=UNKNOWN
PartitionName=e2e Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
    start_cluster && break
    # A port taken since the probe, by a process not of this run: the cluster on other ports.
    if [ -z "${ENGINE_E2E_SLURM_PORT:-}" ] && ((try < 3)) && port_taken "$FAILED_PORT"; then
        log "port $FAILED_PORT was taken meanwhile by $HOLDER: the cluster again, on other ports"
        stop_cluster
        FROM=$((FAILED_PORT + 1))
        continue
    fi
    die "$FAILED"
done
exec {LOCK}>&-
for _ in $(seq 1 100); do
    [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$')" = 2 ] && break
    sleep 0.2
done
[ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$')" = 2 ] || die "the nodes are not idle after 20 s:
$(sinfo -N 2>&1)
$(cluster_logs)"
# shellcheck disable=SC2016 # expanded by the tasks
ids=$(srun -N 2 -n 4 bash -c 'echo "$SLURM_NODEID $SLURMD_NODENAME"' 2>"$WORK/srun-nodes.err" | sort -u | tr '\n' ' ') || true
[ "$ids" = "0 n1 1 n2 " ] || die "srun -N 2 -n 4: nodes '$ids', expected 0 n1 and 1 n2; srun said: $(cat "$WORK/srun-nodes.err")
$(cluster_logs)"
srun -N 2 -n 4 "$ENGINE" dist check >"$WORK/dist-check.txt" 2>&1 || die "engine dist check under srun: $(cat "$WORK/dist-check.txt")"
[ "$(grep -c ' ok, token ' "$WORK/dist-check.txt")" = 4 ] && [ "$(grep -o 'token [0-9a-f]*' "$WORK/dist-check.txt" | sort -u | wc -l)" = 1 ] \
    || die "engine dist check: $(cat "$WORK/dist-check.txt")"

# --- the template ------------------------------------------------------------------------------

# The shapes of the engine's tests of tiny recipes (engine/src/train/devices.rs), made smaller:
# a step takes milliseconds.
SHAPES=(--set model.vocab_size=512 --set train.seq_len=32 --set model.mlp_dim=1024 --set optim.warmup_steps=2)
# 2 nodes x 2 tasks: FSDP over the tasks of a node, data parallelism across the nodes.
MESH=(--set mesh.ici_fsdp=2 --set mesh.dcn_data=2)

# submit NAME ARGS...: the template, bare metal on the CPU, run directory $WORK/runs/NAME; prints
# the job id.
submit() {
    local name=$1
    shift
    (cd "$WORK" && env -u IMAGE ENGINE="$ENGINE" DEVICE=cpu RECIPE=tiny-llama2 RUN_DIR="$WORK/runs/$name" \
        sbatch --parsable --nodes=2 --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 "$TEMPLATE" "$@")
}

# job_field ID FIELD: a field of `scontrol show job` (JobState, Restarts, ...).
job_field() { scontrol show job -o "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"; }

job_failed() { # job_failed ID WHY: the job's log, then fail
    {
        echo "--- scontrol show job $1"
        scontrol show job "$1" || true
        echo "--- $WORK/engine-train-$1.log"
        cat "$WORK/engine-train-$1.log" || true
    } >&2
    die "$2"
}

# wait_job ID SECONDS: until the job has ended; it must have COMPLETED.
wait_job() {
    local id=$1 state
    for _ in $(seq 1 $(($2 * 5))); do
        state=$(job_field "$id" JobState)
        case $state in
        COMPLETED) return ;;
        PENDING | CONFIGURING | RUNNING | COMPLETING | REQUEUED) sleep 0.2 ;;
        *) job_failed "$id" "job $id ended $state" ;;
        esac
    done
    job_failed "$id" "job $id did not end within $2 s (state $state)"
}

# wait_state ID SECONDS STATE: until the job is in STATE.
wait_state() {
    local id=$1 state
    for _ in $(seq 1 $(($2 * 5))); do
        state=$(job_field "$id" JobState)
        [ "$state" = "$3" ] && return
        sleep 0.2
    done
    job_failed "$id" "job $id did not become $3 within $2 s (state $state)"
}

# start_now ID: a requeued (pending) job may start now instead of in two minutes. Slurm holds it
# that long so that its new job credential is newer than the revoked one: starting within the
# second of the revocation fails it ("Job credential revoked"), so wait for the next second.
start_now() {
    sleep 2
    scontrol update JobId="$1" StartTime=now
}

# last_step RUN_DIR: the highest step in its metrics.jsonl (0 without one).
last_step() { { sed -n 's/.*"step":\([0-9]*\).*/\1/p' "$1/metrics.jsonl" 2>/dev/null || true; } | sort -n | tail -1 | grep . || echo 0; }

# wait_step ID RUN_DIR STEP SECONDS: until the running job has logged STEP or later.
wait_step() {
    local id=$1 dir=$2 step=$3
    for _ in $(seq 1 $(($4 * 10))); do
        [ "$(last_step "$dir")" -ge "$step" ] && return
        case $(job_field "$id" JobState) in
        PENDING | CONFIGURING | RUNNING) sleep 0.1 ;;
        *) job_failed "$id" "job $id ended before step $step: make the run longer" ;;
        esac
    done
    job_failed "$id" "job $id did not reach step $step within $4 s"
}

# curve METRICS: "step loss" lines, one per step (a step logged again after a restart: the last
# record), in step order.
curve() {
    awk 'match($0, /"step":[0-9]+/) { s = substr($0, RSTART + 7, RLENGTH - 7) + 0
         if (match($0, /"loss":[-+0-9.eE]+/)) loss[s] = substr($0, RSTART + 7, RLENGTH - 7) }
         END { for (s in loss) print s, loss[s] }' "$1" | sort -n
}

# same_curve WHAT WANT GOT STEPS: both have steps 1..STEPS, losses within 1e-5 relative.
same_curve() {
    local report
    report=$(awk -v steps="$4" 'FNR == NR { want[$1] = $2; next } { got[$1] = $2 }
        END {
            for (s = 1; s <= steps; s++) {
                if (!(s in want) || !(s in got)) { printf "step %d missing (reference %s, job %s)\n", s, want[s], got[s]; bad = 1; continue }
                d = want[s] - got[s]; if (d < 0) d = -d
                w = want[s] < 0 ? -want[s] : want[s]
                if (d > 1e-5 * w) { printf "step %d: loss %s in the job, %s in one process (relative %.2e)\n", s, got[s], want[s], d / w; bad = 1 }
            }
            exit bad
        }' <(curve "$2") <(curve "$3")) || die "$1: the job's curve is not the single-process curve:
$report"
}

# reference NAME STEPS ARGS...: one process training the job's global batch (4 x the per-task
# batch of 1), no mesh.
reference() {
    local name=$1 steps=$2
    shift 2
    "$ENGINE" train --device cpu --recipe tiny-llama2 --steps "$steps" --run-dir "$WORK/runs/$name" \
        "${SHAPES[@]}" --set train.batch_size=4 "$@" >"$WORK/$name.log" 2>&1 \
        || die "the single-process run $name failed: $(tail -5 "$WORK/$name.log")"
}

STEPS=8
log "the template on 2 nodes x 2 tasks, $STEPS steps, against one process"
id=$(submit curve --steps "$STEPS" "${SHAPES[@]}" "${MESH[@]}")
reference curve-ref "$STEPS"
wait_job "$id" 120
grep -q "^engine-train: job $id start 0 " "$WORK/engine-train-$id.log" || job_failed "$id" "the job's log does not say it started"
same_curve "2 nodes x 2 tasks" "$WORK/runs/curve-ref/metrics.jsonl" "$WORK/runs/curve/metrics.jsonl" "$STEPS"
log "the job's curve is the single-process curve ($STEPS steps)"

STEPS=40
EVERY=10
log "requeue: $STEPS steps with a checkpoint every $EVERY, stopped by scontrol requeue, then by the time limit's warning"
id=$(submit requeue --steps "$STEPS" --set train.checkpoint_every=$EVERY "${SHAPES[@]}" "${MESH[@]}")
reference requeue-ref "$STEPS" --set train.checkpoint_every=$EVERY
dir=$WORK/runs/requeue

# 1. Preemption or an operator: Slurm SIGTERMs every task and requeues the job.
wait_step "$id" "$dir" $((EVERY + 2)) 120
scontrol requeue "$id"
wait_state "$id" 60 PENDING
stop1=$(last_step "$dir")
log "requeued by scontrol at step $stop1"
start_now "$id"
# 2. The time limit's warning (--signal=B:USR1@300) to the batch script: it passes the signal to
#    the ranks through srun and, when they have saved (exit 76), requeues the job itself.
wait_state "$id" 60 RUNNING
wait_step "$id" "$dir" $((stop1 + EVERY + 2)) 120
scancel --batch --signal=USR1 "$id"
wait_state "$id" 60 PENDING
stop2=$(last_step "$dir")
log "requeued by the template at step $stop2 (SIGUSR1 to the batch script)"
grep -q "^engine-train: saved before the time limit; requeueing job $id" "$WORK/engine-train-$id.log" \
    || job_failed "$id" "the template did not requeue the job after SIGUSR1"
start_now "$id"
wait_job "$id" 180

[ "$(job_field "$id" Restarts)" = 2 ] || job_failed "$id" "job $id: Restarts=$(job_field "$id" Restarts), expected 2"
[ "$(grep -c "^engine-train: job $id start " "$WORK/engine-train-$id.log")" = 3 ] || job_failed "$id" "the log does not show three starts"
# Each stop saved the step it stopped at, which the next start continued.
for stop in "$stop1" "$stop2"; do
    grep -q "^resuming after step $stop from $dir/checkpoints/step-$(printf %06d "$stop")\$" "$WORK/engine-train-$id.log" \
        || job_failed "$id" "the job stopped at step $stop but did not resume from its checkpoint"
done
same_curve "requeued twice" "$WORK/runs/requeue-ref/metrics.jsonl" "$dir/metrics.jsonl" "$STEPS"
log "the requeued job (stopped at steps $stop1 and $stop2) ends on the uninterrupted curve ($STEPS steps)"

STEPS=60
EVERY=10

# killed NAME WHAT ARGS...: the job NAME (ARGS added to its train command) killed 3 times as the
# header says, ending on the uninterrupted curve, with `engine goodput` accounting for 95 % of
# its attempts' wall time. Sets RECOMPUTED to the steps its restarts computed again.
killed() {
    local name=$1 what=$2
    shift 2
    log "SIGKILL ($what): $STEPS steps with a checkpoint every $EVERY, a rank chosen at random killed 3 times, the job requeued"
    id=$(submit "$name" --steps "$STEPS" --set train.checkpoint_every=$EVERY "${SHAPES[@]}" "${MESH[@]}" "$@")
    [ -e "$WORK/runs/killed-ref/metrics.jsonl" ] || reference killed-ref "$STEPS" --set train.checkpoint_every=$EVERY
    dir=$WORK/runs/$name
    engine_exe=$(readlink -f "$ENGINE")
    at=0
    for kill in 1 2 3; do
        # Past the last kill's step and a few steps past a checkpoint, so that some are lost.
        wait_step "$id" "$dir" $((at + 5)) 120
        ranks=()
        for p in $(pgrep -f -- "--run-dir $dir" || true); do
            [ "$(readlink -f "/proc/$p/exe" 2>/dev/null)" = "$engine_exe" ] && ranks+=("$p")
        done
        [ "${#ranks[@]}" = 4 ] || job_failed "$id" "kill $kill: found ${#ranks[@]} engine ranks of job $id, expected 4"
        victim=$((RANDOM % 4))
        kill -9 "${ranks[$victim]}"
        at=$(last_step "$dir")
        # The others see it leave and exit 75; the job fails, and is requeued as a watcher would.
        wait_state "$id" 120 FAILED
        log "kill $kill: SIGKILL to process ${ranks[$victim]} (of the 4 ranks' processes, number $victim) at step $at; job $id failed, requeued"
        scontrol requeue "$id"
        wait_state "$id" 60 PENDING
        start_now "$id"
        wait_state "$id" 60 RUNNING
    done
    wait_job "$id" 240
    same_curve "killed 3 times ($what)" "$WORK/runs/killed-ref/metrics.jsonl" "$dir/metrics.jsonl" "$STEPS"
    log "the job killed 3 times ($what) ends on the uninterrupted curve ($STEPS steps)"

    # engine goodput: 4 attempts, and what no cause explains under 5 % of the attempts' summed
    # wall time (the run's wall less the time between attempts).
    "$ENGINE" goodput "$dir" >"$WORK/goodput-$name.txt" || die "engine goodput $dir: $(cat "$WORK/goodput-$name.txt")"
    cat "$WORK/goodput-$name.txt" >&2
    grep -q "^goodput of $dir (4 attempts)" "$WORK/goodput-$name.txt" || die "engine goodput: expected 4 attempts"
    awk '$1 == "wall" { wall = $6 } $1 == "unaccounted" { unaccounted = $6 } /^idle between attempts/ { idle = $8 }
         END { attempts = wall - idle; share = 100 * (attempts - unaccounted) / attempts
               printf "goodput: causes account for %.1f %% of the attempts'"'"' %.2f s\n", share, attempts > "/dev/stderr"
               exit !(share >= 95) }' "$WORK/goodput-$name.txt" || die "engine goodput accounts for less than 95 % of the attempts' wall time"
    RECOMPUTED=$(sed -n 's/.* steps run, \([0-9]*\) of them recomputed after a restart$/\1/p' "$WORK/goodput-$name.txt")
    [ -n "$RECOMPUTED" ] || die "engine goodput: no count of recomputed steps"
}

killed killed "persistent tier only"
persistent=$RECOMPUTED
# The same job with the local tier (train.local_checkpoint_every = 2, in /dev/shm keyed by the
# run): a rank's process killed leaves its node's copies, so each restart loses at most a step or two.
killed killed-local "local tier every 2 steps" --set train.local_checkpoint_every=2
# The local tier's copies, in memory, go with the test's run.
rm -rf "/dev/shm/engine-local-$(printf %s "$(readlink -f "$WORK/runs/killed-local")" | sha256sum | cut -c1-16)"
log "recomputed steps: $persistent with the persistent tier only, $RECOMPUTED with the local tier"
[ "$RECOMPUTED" -lt "$persistent" ] || die "the local tier recomputed $RECOMPUTED steps, not fewer than the persistent tier's $persistent"
