#!/usr/bin/env bash
# Stop the single-node SLURM that scripts/slurm/setup_local_slurm.sh started:
# slurmd, slurmctld, slurmdbd, MariaDB and munged (each by the pid in its pidfile).
# Packages, configuration, the accounting database and fake /dev/nvidiaN nodes stay,
# so setup_local_slurm.sh brings everything back in seconds.
# Usage: scripts/slurm/stop_local_slurm.sh [--cancel-jobs]   (--cancel-jobs: scancel all first)
set -uo pipefail

[[ $(id -u) == 0 ]] || { echo "stop_local_slurm: ERROR: must run as root" >&2; exit 10; }

if [[ ${1:-} == --cancel-jobs ]] && command -v scancel >/dev/null; then
    scancel --full --state=PENDING,RUNNING --user="$(id -un)" 2>/dev/null
    scancel --full --state=PENDING,RUNNING 2>/dev/null
fi

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

stop slurmd /run/slurmd.pid
stop slurmctld /run/slurmctld.pid
stop slurmdbd /run/slurmdbd.pid
stop MariaDB /run/mysqld/mysqld.pid
stop munged /run/munge/munged.pid
echo "local SLURM stopped (start it again with scripts/slurm/setup_local_slurm.sh)"
