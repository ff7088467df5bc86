#!/usr/bin/env bash
# Install and start a real single-node SLURM cluster on this host (Debian/Ubuntu, root).
#
# What it sets up (idempotent: run it again any time; it only fixes what is missing):
#   - packages slurm-wlm, munge (+ slurmdbd, mariadb-server for accounting) via apt-get
#   - munged with a key, MariaDB on a local socket, slurmdbd, slurmctld, slurmd
#   - /etc/slurm/slurm.conf with this host as the only node (its line from `slurmd -C`),
#     GPUs as GRES: the real /dev/nvidiaN devices, or, on a host without any, fake ones
#     made with `mknod /dev/nvidiaN c 1 3` (so `--gpus=N` jobs schedule and get
#     CUDA_VISIBLE_DEVICES, while torch sees no CUDA and runs on CPU)
#   - accounting through slurmdbd, tracking gres/gpu, so that `sacct` lists every job
#     with the resources it asked for (ReqTRES) and got (AllocTRES), and its comment
#     (the Snakemake SLURM plugin puts the rule name there: `sacct -o JobID,Comment%60,ReqTRES`)
#
# Usage:   scripts/slurm/setup_local_slurm.sh        (stop: scripts/slurm/stop_local_slurm.sh)
# Env:     DRAFTFLOW_SLURM_FAKE_GPUS=2     fake GPUs to create when the host has none
#          DRAFTFLOW_SLURM_ACCOUNTING=slurmdbd|none   none: skip MariaDB/slurmdbd (no sacct)
#          DRAFTFLOW_SLURM_WAIT=90         seconds to wait for each daemon / the node
# Exit codes (distinct, so callers can tell "cannot install here" from "broken"):
#   0 ready   10 not root   11 packages cannot be installed (no apt-get, no network)
#   12 munge failed   13 accounting (MariaDB/slurmdbd) failed   14 slurmctld/slurmd/node failed
#   15 /etc/slurm/slurm.conf exists but was not written by this script (a real cluster's?)
set -uo pipefail

FAKE_GPUS=${DRAFTFLOW_SLURM_FAKE_GPUS:-2}
ACCOUNTING=${DRAFTFLOW_SLURM_ACCOUNTING:-slurmdbd}
WAIT=${DRAFTFLOW_SLURM_WAIT:-90}
CLUSTER=draftflow
PARTITION=debug
HOST=$(hostname -s)
CONF=/etc/slurm
LOGDIR=/var/log/slurm
MYSQL_SOCK=/run/mysqld/mysqld.sock
T0=$SECONDS

say() { echo "[setup_local_slurm $((SECONDS - T0))s] $*"; }
die() { # die CODE MESSAGE: say what failed and how to look into it
    echo "setup_local_slurm: ERROR: $2" >&2
    exit "$1"
}
# wait_for SECONDS COMMAND...: retry COMMAND every 0.5 s until it succeeds
wait_for() {
    local deadline=$((SECONDS + $1)); shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS >= deadline)) && return 1
        sleep 0.5
    done
}
# alive PIDFILE: the daemon whose pid is in PIDFILE is running
alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
# stop_pidfile PIDFILE: stop that daemon and wait until it is gone
stop_pidfile() {
    alive "$1" || return 0
    local pid; pid=$(cat "$1")
    kill "$pid" 2>/dev/null
    wait_for 30 bash -c "! kill -0 $pid" || kill -9 "$pid" 2>/dev/null
    rm -f "$1"
}

# --- 0. preconditions -------------------------------------------------------------------
[[ $(id -u) == 0 ]] || die 10 "must run as root (apt-get, munge and the SLURM daemons need it); try: sudo $0"
if [[ -e $CONF/slurm.conf ]] && ! grep -q "Written by draftflow" "$CONF/slurm.conf"; then
    die 15 "$CONF/slurm.conf was not written by this script; not touching an existing SLURM setup (move it away to let this script manage the host)"
fi
[[ $ACCOUNTING == slurmdbd || $ACCOUNTING == none ]] ||
    die 14 "DRAFTFLOW_SLURM_ACCOUNTING must be 'slurmdbd' or 'none', not '$ACCOUNTING'"

# --- 1. packages ------------------------------------------------------------------------
PKGS=(slurm-wlm munge)
[[ $ACCOUNTING == slurmdbd ]] && PKGS+=(slurmdbd mariadb-server)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die 11 "apt-get not found: install ${missing[*]} with your package manager"
    say "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/tmp/draftflow-slurm-apt.log 2>&1 ||
        die 11 "apt-get update failed (no network or no package mirror?); see /tmp/draftflow-slurm-apt.log"
    apt-get install -y -q --no-install-recommends "${missing[@]}" >>/tmp/draftflow-slurm-apt.log 2>&1 ||
        die 11 "apt-get install ${missing[*]} failed; see /tmp/draftflow-slurm-apt.log"
fi

# --- 2. munge ---------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    say "creating /etc/munge/munge.key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
if ! alive /run/munge/munged.pid; then
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged --force </dev/null >/dev/null 2>&1 ||
        die 12 "munged did not start; see /var/log/munge/munged.log"
fi
wait_for "$WAIT" bash -c "munge -n | unmunge" ||
    die 12 "munge credentials do not round-trip ('munge -n | unmunge'); see /var/log/munge/munged.log"

# --- 3. GPUs as GRES ----------------------------------------------------------------------
# A real NVIDIA device node has major number 195; our fakes are copies of /dev/null (1:3).
real_gpus=0
for d in /dev/nvidia[0-9]*; do
    [[ -c $d && $(stat -c %t "$d") == c3 ]] && real_gpus=$((real_gpus + 1))
done
if ((real_gpus > 0)); then
    NGPUS=$real_gpus
    say "found $NGPUS real GPU device(s)"
else
    NGPUS=$FAKE_GPUS
    for ((i = 0; i < NGPUS; i++)); do
        [[ -e /dev/nvidia$i ]] || mknod -m 0666 "/dev/nvidia$i" c 1 3
    done
    ((NGPUS > 0)) && say "no real GPU: using $NGPUS fake GPU device(s) /dev/nvidia[0-$((NGPUS - 1))]"
fi

# --- 4. configuration files (written to a scratch dir, installed only when changed) -----
new=$(mktemp -d)
trap 'rm -rf "$new"' EXIT
# The node line must match the hardware (`slurmd -C`) or the node turns INVAL; keep
# RealMemory below what the host reports (90 %) so small fluctuations never drain it.
node_line=$(slurmd -C | head -1)
mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")
node_line=$(sed "s/RealMemory=[0-9]*/RealMemory=$((mem * 9 / 10))/" <<<"$node_line")
((NGPUS > 0)) && node_line+=" Gres=gpu:$NGPUS"
if [[ $ACCOUNTING == slurmdbd ]]; then
    acct="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
    acct="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi
cat >"$new/slurm.conf" <<EOF
# Written by draftflow scripts/slurm/setup_local_slurm.sh: a single-node test cluster.
ClusterName=$CLUSTER
SlurmctldHost=$HOST
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
GresTypes=gpu
ReturnToService=2
SchedulerType=sched/backfill
MinJobAge=300
$acct
$node_line State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
if ((NGPUS > 0)); then
    echo "NodeName=$HOST Name=gpu File=/dev/nvidia[0-$((NGPUS - 1))]" >"$new/gres.conf"
else
    : >"$new/gres.conf"
fi
if [[ $ACCOUNTING == slurmdbd ]]; then
    # Keep the database password across runs (it lives only in this root-only file).
    pass=$(sed -n 's/^StoragePass=//p' "$CONF/slurmdbd.conf" 2>/dev/null)
    [[ -n $pass ]] || pass=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
    cat >"$new/slurmdbd.conf" <<EOF
# Written by draftflow scripts/slurm/setup_local_slurm.sh
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=/run/slurmdbd.pid
LogFile=$LOGDIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageUser=slurm
StoragePass=$pass
StorageLoc=slurm_acct_db
EOF
fi
install -d -m 0755 "$CONF" "$LOGDIR" /var/spool/slurmctld /var/spool/slurmd
changed=0
for f in slurm.conf gres.conf slurmdbd.conf; do
    [[ -e $new/$f ]] || continue
    if ! cmp -s "$new/$f" "$CONF/$f"; then
        install -m "$([[ $f == slurmdbd.conf ]] && echo 0600 || echo 0644)" "$new/$f" "$CONF/$f"
        changed=1
    fi
done
if ((changed)); then
    say "configuration written to $CONF; restarting the SLURM daemons that run"
    stop_pidfile /run/slurmd.pid
    stop_pidfile /run/slurmctld.pid
    stop_pidfile /run/slurmdbd.pid
fi

# --- 5. accounting: MariaDB + slurmdbd --------------------------------------------------
if [[ $ACCOUNTING == slurmdbd ]]; then
    if ! mysqladmin --socket="$MYSQL_SOCK" ping >/dev/null 2>&1; then
        say "starting MariaDB (local socket only)"
        install -d -o mysql -g mysql -m 0755 /run/mysqld /var/log/mysql
        [[ -d /var/lib/mysql/mysql ]] ||
            mariadb-install-db --user=mysql >/var/log/mysql/install.log 2>&1 ||
            die 13 "mariadb-install-db failed; see /var/log/mysql/install.log"
        setsid /usr/sbin/mariadbd --user=mysql --skip-networking --socket="$MYSQL_SOCK" \
            --pid-file=/run/mysqld/mysqld.pid --innodb-buffer-pool-size=64M \
            --log-error=/var/log/mysql/error.log </dev/null >/dev/null 2>&1 &
        wait_for "$WAIT" mysqladmin --socket="$MYSQL_SOCK" ping ||
            die 13 "MariaDB did not start; see /var/log/mysql/error.log"
    fi
    mysql --socket="$MYSQL_SOCK" -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost';
        ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pass';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" ||
        die 13 "could not create the database user 'slurm' in MariaDB"
    if ! alive /run/slurmdbd.pid; then
        say "starting slurmdbd"
        slurmdbd </dev/null >/dev/null 2>&1 || die 13 "slurmdbd did not start; see $LOGDIR/slurmdbd.log"
    fi
    wait_for "$WAIT" sacctmgr -n list cluster ||
        die 13 "slurmdbd does not answer ('sacctmgr list cluster'); see $LOGDIR/slurmdbd.log"
    if [[ -z $(sacctmgr -n -P list cluster "$CLUSTER" format=cluster) ]]; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null || die 13 "sacctmgr add cluster $CLUSTER failed"
    fi
fi

# --- 6. slurmctld + slurmd --------------------------------------------------------------
if ! alive /run/slurmctld.pid; then
    say "starting slurmctld"
    slurmctld </dev/null >/dev/null 2>&1 || die 14 "slurmctld did not start; see $LOGDIR/slurmctld.log"
fi
wait_for "$WAIT" scontrol ping || die 14 "slurmctld does not answer ('scontrol ping'); see $LOGDIR/slurmctld.log"
if ! alive /run/slurmd.pid; then
    say "starting slurmd"
    slurmd </dev/null >/dev/null 2>&1 || die 14 "slurmd did not start; see $LOGDIR/slurmd.log"
fi
node_state() { sinfo -h -n "$HOST" -o %T 2>/dev/null; }
node_ready() { [[ $(node_state) =~ ^(idle|mixed|allocated|completing)$ ]]; }
if ! wait_for "$WAIT" node_ready; then
    # A node left down/drained by an earlier run (e.g. a reboot) comes back with resume.
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1
    wait_for 20 node_ready ||
        die 14 "node $HOST is '$(node_state)', not idle: $(sinfo -h -R -o '%E' -n "$HOST"); see $LOGDIR/slurmd.log and 'scontrol show node $HOST'"
fi
say "SLURM is up: cluster '$CLUSTER', partition '$PARTITION', node $HOST ($(node_state)), $NGPUS GPU(s), accounting: $ACCOUNTING"
