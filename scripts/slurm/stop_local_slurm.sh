#!/usr/bin/env bash
# Stop the single-node SLURM that scripts/slurm/setup_local_slurm.sh started:
# slurmd, slurmctld, slurmdbd, MariaDB and munged (each by the pid in its pidfile), or some of them.
# Packages, configuration, the accounting database and fake /dev/nvidiaN nodes stay,
# so setup_local_slurm.sh brings everything back in seconds.
# Usage: scripts/slurm/stop_local_slurm.sh [--cancel-jobs] [DAEMON...]
#   --cancel-jobs: scancel all jobs first
#   DAEMON: stop only these (slurmd slurmctld slurmdbd mariadbd munged); default: all of them
set -uo pipefail

[[ $(id -u) == 0 ]] || { echo "stop_local_slurm: ERROR: must run as root" >&2; exit 10; }

if [[ ${1:-} == --cancel-jobs ]]; then
    shift
    if command -v scancel >/dev/null; then
        scancel --full --state=PENDING,RUNNING --user="$(id -un)" 2>/dev/null
        scancel --full --state=PENDING,RUNNING 2>/dev/null
    fi
fi
ALL=(slurmd slurmctld slurmdbd mariadbd munged)
WANTED=("${@:-${ALL[@]}}")
for d in "${WANTED[@]}"; do
    [[ " ${ALL[*]} " == *" $d "* ]] || { echo "stop_local_slurm: ERROR: unknown daemon '$d' (known: ${ALL[*]})" >&2; exit 2; }
done
wanted() { [[ " ${WANTED[*]} " == *" $1 "* ]]; }

stop() { # stop NAME PIDFILE: TERM, wait up to 30 s, then KILL
    local name=$1 pidfile=$2 pid
    [[ -s $pidfile ]] || return 0
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        echo "stopping $name (pid $pid)"
        kill "$pid"
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && { echo "  $name ignores TERM: killing it"; kill -9 "$pid"; }
    fi
    rm -f "$pidfile"
}

# Dependents first: slurmd and slurmctld talk to slurmdbd, which needs MariaDB; all need munge.
wanted slurmd && stop slurmd /run/slurmd.pid
wanted slurmctld && stop slurmctld /run/slurmctld.pid
wanted slurmdbd && stop slurmdbd /run/slurmdbd.pid
wanted mariadbd && stop MariaDB /run/mysqld/mysqld.pid
wanted munged && stop munged /run/munge/munged.pid
echo "stopped: ${WANTED[*]} (start again with scripts/slurm/setup_local_slurm.sh)"
