#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for the integration tests (run as root).
#
#   scripts/slurm_cluster.sh start    install slurm-wlm + munge if missing, write slurm.conf,
#                                     start munged, slurmctld, slurmd; wait until the node is idle
#   scripts/slurm_cluster.sh status   the daemons and `sinfo`; exit 0 only when the node is up
#   scripts/slurm_cluster.sh stop     stop the daemons this script started (by their pid files)
#
# Settings (environment; `stop` first to change them on a running cluster):
#   SLURM_CLUSTER_DIR   state, spool, logs, pid files and slurm.conf   (/tmp/amp_lab_slurm)
#   SLURM_CLUSTER_CPUS  CPUs the node offers; may exceed the cores, e.g. 4 on a 2-core machine so
#                       two 2-CPU tasks fit (default: nproc)
#   SLURM_CLUSTER_PORT  slurmctld port; slurmd uses the next one                 (6817)
#   SLURM_CLUSTER_REQUEUE_DELAY  seconds before a requeued job may start again     (10)
# Clients find the cluster through /etc/slurm/slurm.conf (written when absent or ours) or
# SLURM_CONF=$SLURM_CLUSTER_DIR/slurm.conf; the tests use only the latter, and only while `status`
# says the cluster is up (tests/helpers/slurm.py).
set -euo pipefail

DIR=${SLURM_CLUSTER_DIR:-/tmp/amp_lab_slurm}
# GNU nproc obeys OMP_NUM_THREADS (the tests set it to 1): count the machine's cores without it
CPUS=${SLURM_CLUSTER_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
PORT=${SLURM_CLUSTER_PORT:-6817}
HOST=$(hostname -s)
CONF=$DIR/slurm.conf
MARKER="# written by amp_lab scripts/slurm_cluster.sh"
export SLURM_CONF=$CONF

log() { echo "slurm_cluster: $*" >&2; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v munged >/dev/null && command -v sbatch >/dev/null; then
        return
    fi
    log "installing slurm-wlm and munge (Debian packages)"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge
}

write_conf() {
    # memory the node offers: total RAM less 1 GiB for the system, in MB
    local mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
    mkdir -p "$DIR"/{state,spool,log,run,munge}
    cat > "$CONF" <<EOF
$MARKER
ClusterName=amplab
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also the wait before a requeued job may start again (SLURM's default 120 s;
# a job step must launch within it)
AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=${SLURM_CLUSTER_REQUEUE_DELAY:-10}
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# no cgroups in a container: track processes through /proc, bind nothing
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
# look for startable jobs every few seconds (a requeued job becomes eligible on a timer)
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
# finished jobs leave the queue after 10 s; a killed job gets 10 s between TERM and KILL
MinJobAge=10
KillWait=10
InactiveLimit=0
JobRequeue=1
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem_mb State=UNKNOWN
# a time limit, as real partitions have (the GPU preset's 240 min fits); EnforcePartLimits stays
# SLURM's default (NO): a job over it pends (PartitionTimeLimit) instead of being refused
PartitionName=debug Nodes=$HOST Default=YES MaxTime=04:00:00 State=UP
EOF
    if [[ ! -e /etc/slurm/slurm.conf ]] || grep -qF "$MARKER" /etc/slurm/slurm.conf; then
        mkdir -p /etc/slurm
        cp "$CONF" /etc/slurm/slurm.conf  # plain `sbatch` in any shell finds this cluster
    fi
}

node_state() { sinfo -h -n "$HOST" -o %T 2>/dev/null | head -n1; }

# up: idle, or running jobs, or finishing one (completing: a requeued job's node is, for seconds)
node_up() { [[ $(node_state) =~ ^(idle|mix|alloc|comp) ]]; }

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    install_packages
    if alive "$DIR/run/slurmctld.pid" && node_up; then
        log "already running ($CONF)"
        return
    fi
    stop_daemons
    write_conf
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile /etc/munge/munge.key
    munged --force --socket="$DIR/munge/munge.socket.2" --pid-file="$DIR/run/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
    slurmctld -c -f "$CONF"  # -c: a clean start, no jobs left from an earlier cluster
    slurmd -f "$CONF"
    for _ in $(seq 60); do
        case $(node_state) in
            idle*) log "up: node $HOST, $CPUS CPUs, partition debug (SLURM_CONF=$CONF)"; return ;;
            down*|drain*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
        esac
        sleep 1
    done
    log "the node did not become idle; see $DIR/log/"
    tail -n 20 "$DIR"/log/*.log >&2
    exit 1
}

stop_daemons() {
    local name pid
    for name in slurmd slurmctld munged; do
        if alive "$DIR/run/$name.pid"; then
            pid=$(cat "$DIR/run/$name.pid")
            kill "$pid"
            for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            log "stopped $name ($pid)"
        fi
        rm -f "$DIR/run/$name.pid"
    done
}

status() {
    local name
    for name in munged slurmctld slurmd; do
        if alive "$DIR/run/$name.pid"; then
            echo "$name: running ($(cat "$DIR/run/$name.pid"))"
        else
            echo "$name: stopped"
        fi
    done
    # without its controller sinfo retries for ~9 s before it fails: say stopped at once
    alive "$DIR/run/slurmctld.pid" || return 1
    sinfo 2>/dev/null || true
    node_up
}

case ${1:-} in
    start) start ;;
    stop) stop_daemons ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
