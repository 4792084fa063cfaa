#!/usr/bin/env bash
# A one-node SLURM cluster on loopback with fake GPUs, for the `slurm` integration test
# (tests/test_slurm.py) and for trying the `slurm` profile by hand. Needs root and Debian's packages.
#
#   tests/slurm/cluster.sh install          apt-get install slurmctld slurmd slurm-client munge (if missing)
#   tests/slurm/cluster.sh start STATE_DIR  munged, slurmctld, slurmd; everything they write lies in STATE_DIR
#   tests/slurm/cluster.sh stop STATE_DIR   cancels the jobs, stops the three daemons by PID, removes STATE_DIR
#
# The node has K2VEC_SLURM_GPUS (4) GPUs of type `fake`: character devices like /dev/null made with mknod
# (slurmd refuses regular files), listed in gres.conf with AutoDetect=off, and K2VEC_SLURM_CPUS (8) CPUs
# whatever the machine has (config_overrides). No cgroups: proctrack/linuxproc, task/none, so nothing
# confines a job to its device but CUDA_VISIBLE_DEVICES, which is what the test checks.
# slurm.conf lives in STATE_DIR, and /etc/slurm/slurm.conf is a symlink to it while the cluster runs: the
# executor plugin's job step (snakemake-executor-plugin-slurm-jobstep) drops SLURM_CONF before its srun,
# which then reads only the default path. `start` refuses to run over an existing /etc/slurm/slurm.conf.
set -euo pipefail

NODE=k2vec-node
PARTITION=k2vec
GPUS=${K2VEC_SLURM_GPUS:-4}
CPUS=${K2VEC_SLURM_CPUS:-8}
CTLD_PORT=${K2VEC_SLURM_CTLD_PORT:-16817}
SLURMD_PORT=${K2VEC_SLURM_SLURMD_PORT:-16818}
SYSTEM_CONF=/etc/slurm/slurm.conf
DAEMONS=(slurmd slurmctld munged)   # stopped in this order

die() { echo "cluster.sh: $*" >&2; exit 1; }

install_packages() {
    local missing=()
    for cmd in slurmctld slurmd sbatch munged; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || die "installing slurm needs root (missing: ${missing[*]})"
    # Debian's policy-rc.d (present in containers) keeps the packages from starting system-wide daemons.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
}

write_config() {
    local state=$1 ctld_host
    ctld_host=$(hostname -s)   # slurmctld only runs on a host named in SlurmctldHost
    cat >"$state/slurm.conf" <<CONF
ClusterName=k2vec-test
SlurmctldHost=$ctld_host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$state/munge/munge.socket
StateSaveLocation=$state/slurmctld
SlurmdSpoolDir=$state/slurmd
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
# Without accounting, squeue is the executor's only status source: keep finished jobs listed.
MinJobAge=3600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=16000 Gres=gpu:fake:$GPUS State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
    cat >"$state/gres.conf" <<CONF
AutoDetect=off
NodeName=$NODE Name=gpu Type=fake File=$state/dev/fakegpu[0-$((GPUS - 1))]
CONF
}

start() {
    local state=$1
    [ "$(id -u)" -eq 0 ] || die "start needs root (slurmd launches jobs as their users)"
    [ -e "$SYSTEM_CONF" ] || [ -L "$SYSTEM_CONF" ] && die "$SYSTEM_CONF exists: another SLURM setup is here; not touching it"
    mkdir -p "$state"
    [ -z "$(ls -A "$state")" ] || die "state directory $state is not empty"
    # A half-started cluster is stopped and removed again.
    trap 'status=$?; [ $status -eq 0 ] || stop "$state" >&2 || true; exit $status' EXIT
    # munged wants its socket's directory searchable by all and its key's not writable by others.
    chmod 755 "$state"
    mkdir -m 755 "$state/munge"
    mkdir -m 700 "$state/slurmctld" "$state/slurmd" "$state/dev"
    for ((i = 0; i < GPUS; i++)); do mknod "$state/dev/fakegpu$i" c 1 3; done   # 1:3 is /dev/null
    write_config "$state"
    mungekey --create --keyfile="$state/munge/munge.key" >/dev/null
    munged --socket="$state/munge/munge.socket" --key-file="$state/munge/munge.key" \
        --pid-file="$state/munged.pid" --log-file="$state/munged.log" --seed-file="$state/munge/seed"
    mkdir -p "$(dirname "$SYSTEM_CONF")"
    ln -s "$state/slurm.conf" "$SYSTEM_CONF"
    slurmctld -c -f "$state/slurm.conf"
    slurmd -f "$state/slurm.conf" -N "$NODE"
    export SLURM_CONF=$state/slurm.conf
    local deadline=$((SECONDS + 60))
    until [ "$(sinfo -h -n "$NODE" -o %T 2>/dev/null)" = idle ]; do
        [ $SECONDS -lt $deadline ] || { tail -n 20 "$state"/slurm*.log >&2; die "the node did not come up within 60 s"; }
        sleep 0.5
    done
    trap - EXIT
    echo "cluster up: partition $PARTITION, node $NODE with $GPUS fake GPUs; SLURM_CONF=$state/slurm.conf"
}

pid_of() { [ -s "$1/$2.pid" ] && cat "$1/$2.pid"; }

stop() {
    local state=$1 pid deadline
    [ -d "$state" ] || die "no state directory $state"
    state=$(cd "$state" && pwd)
    if [ -s "$state/slurmctld.pid" ] && kill -0 "$(cat "$state/slurmctld.pid")" 2>/dev/null; then
        # Cancel whatever still runs, so no job step outlives slurmd.
        export SLURM_CONF=$state/slurm.conf
        scancel --quiet --partition "$PARTITION" 2>/dev/null || true
        deadline=$((SECONDS + 30))
        while [ -n "$(squeue -h -t RUNNING,COMPLETING -o %i 2>/dev/null)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
    fi
    for daemon in "${DAEMONS[@]}"; do
        pid=$(pid_of "$state" "$daemon") || continue
        kill -0 "$pid" 2>/dev/null || continue
        [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$daemon" ] || { echo "pid $pid is no longer $daemon: left alone" >&2; continue; }
        kill -TERM "$pid"
        deadline=$((SECONDS + 15))
        while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    done
    if [ -L "$SYSTEM_CONF" ] && [ "$(readlink "$SYSTEM_CONF")" = "$state/slurm.conf" ]; then
        rm -f "$SYSTEM_CONF"
    fi
    rm -rf "$state"
    echo "cluster stopped; $state removed"
}

case ${1:-} in
    install) install_packages ;;
    start) [ $# -eq 2 ] || die "usage: $0 start STATE_DIR"; install_packages; start "$2" ;;
    stop) [ $# -eq 2 ] || die "usage: $0 stop STATE_DIR"; stop "$2" ;;
    *) die "usage: $0 install | start STATE_DIR | stop STATE_DIR" ;;
esac
