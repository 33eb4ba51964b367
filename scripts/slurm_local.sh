#!/usr/bin/env bash
# slurm_local.sh - a throwaway single-node SLURM cluster for tests and local experiments.
#
#   bash scripts/slurm_local.sh            install (if needed), configure, start munge+slurmctld+slurmd
#   bash scripts/slurm_local.sh --sacct    the same plus MariaDB + slurmdbd, so that `sacct` works
#                                          (submitit and the slurm tests read job states from sacct)
#   bash scripts/slurm_local.sh --status   daemons and their PIDs, sinfo, squeue
#   bash scripts/slurm_local.sh --stop     cancel the cluster's jobs, stop our daemons by saved PID
#
# Needs root (apt-get and slurmd) on Debian/Ubuntu; no systemd: the daemons run in the foreground
# of their own sessions and their PIDs are saved under $KPOOL_SLURM_DIR/pids. Everything (config,
# munge key and socket, state, spool, logs, database) lives in $KPOOL_SLURM_DIR; /etc is untouched,
# so clients need the line this script prints last:
#     export SLURM_CONF=$KPOOL_SLURM_DIR/slurm.conf
# Re-running is safe: running daemons are kept, and slurmctld/slurmd restart only if slurm.conf changed.
#
# Environment:
#   KPOOL_SLURM_DIR   state directory (default /tmp/kpool-slurm)
#   KPOOL_SLURM_PORTS "ctld slurmd dbd mariadb" TCP ports on 127.0.0.1 (default "6827 6828 6829 3327";
#                     not the SLURM defaults, so a real SLURM on the same host is not disturbed)
#   KPOOL_SLURM_WAIT  seconds to wait for the node to become idle (default 60)
set -euo pipefail

BASE=${KPOOL_SLURM_DIR:-/tmp/kpool-slurm}
read -r CTLD_PORT SLURMD_PORT DBD_PORT DB_PORT <<<"${KPOOL_SLURM_PORTS:-6827 6828 6829 3327}"
WAIT_S=${KPOOL_SLURM_WAIT:-60}
NODE=$(hostname -s)
MUNGE_SOCKET=$BASE/munge/socket
DB_SOCKET=$BASE/run/mariadb.sock
export SLURM_CONF=$BASE/slurm.conf

log() { echo "[slurm_local $(date +%T)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

usage() {
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

# ---- daemons: each runs in the foreground of its own session; we only signal PIDs we saved ------------

# Prints the saved PID of daemon $1 if that process is still alive and still is $1.
daemon_pid() {
    local file=$BASE/pids/$1.pid pid
    [[ -s $file ]] || return 1
    pid=$(<"$file")
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$1" ]] || return 1
    [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]] || return 1
    echo "$pid"
}

# Starts daemon $1 with the command line that follows; its output goes to log/$1.out.
start_daemon() {
    local name=$1
    shift
    # In a script a background job is no process-group leader, so setsid execs in place: $! is the daemon.
    setsid "$@" </dev/null >"$BASE/log/$name.out" 2>&1 &
    echo $! >"$BASE/pids/$name.pid"
    log "started $name (pid $!)"
}

# Stops daemon $1 by its saved PID: SIGTERM, then SIGKILL after 15 s.
stop_daemon() {
    local pid
    if pid=$(daemon_pid "$1"); then
        log "stopping $1 (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 60); do daemon_pid "$1" >/dev/null || break; sleep 0.25; done
        if daemon_pid "$1" >/dev/null; then
            log "$1 ignored SIGTERM for 15 s, sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$BASE/pids/$1.pid"
}

# Fails with a clear message if TCP port $2 (for daemon $1) is taken by someone else.
require_free_port() {
    if ss -Hltn "sport = :$2" 2>/dev/null | grep -q .; then
        die "port $2 needed by $1 is in use; pick others with KPOOL_SLURM_PORTS=\"ctld slurmd dbd mariadb\""
    fi
}

# Polls the command that follows every 0.25 s for up to $1 seconds; returns its last status.
wait_for() {
    local seconds=$1
    shift
    for _ in $(seq $((seconds * 4))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
    "$@" >/dev/null 2>&1
}

# ---- the steps ---------------------------------------------------------------------------------------------

install_packages() {
    local want_acct=$1 pkgs=(slurmctld slurmd slurm-client munge) cmds=(slurmctld slurmd sbatch munged ss)
    [[ $want_acct == 1 ]] && pkgs+=(slurmdbd mariadb-server) cmds+=(slurmdbd mariadbd mariadb-install-db)
    local missing=0 c
    for c in "${cmds[@]}"; do command -v "$c" >/dev/null || missing=1; done
    [[ $missing == 0 ]] && return 0
    [[ $(id -u) == 0 ]] || die "missing SLURM packages and not root; run: sudo apt-get install ${pkgs[*]} iproute2"
    command -v apt-get >/dev/null || die "no apt-get: install ${pkgs[*]} with your package manager"
    log "apt-get install ${pkgs[*]}"
    # policy-rc.d keeps the packages' maintainer scripts from starting services (there is no systemd).
    local policy=/usr/sbin/policy-rc.d own_policy=0 rc=0
    if [[ ! -e $policy ]]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"; own_policy=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" iproute2 \
        >"$BASE/log/apt.log" 2>&1 || rc=$?
    if [[ $rc != 0 ]] && grep -q "Unable to locate\|has no installation candidate" "$BASE/log/apt.log"; then
        log "package lists look stale: apt-get update"
        apt-get update -q >>"$BASE/log/apt.log" 2>&1 && rc=0 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" \
                iproute2 >>"$BASE/log/apt.log" 2>&1 || rc=$?
    fi
    [[ $own_policy == 1 ]] && rm -f "$policy"
    [[ $rc == 0 ]] || { tail -20 "$BASE/log/apt.log" >&2; die "apt-get install failed (log: $BASE/log/apt.log)"; }
}

# Writes slurm.conf; sets CONF_CHANGED=1 if it differs from the one the running daemons read.
write_slurm_conf() {
    local want_acct=$1 node_line accounting
    # What slurmd detects on this host, minus 512 MB of RealMemory so the node never drains on memory.
    node_line=$(slurmd -C | head -1 | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^RealMemory=/) {
        split($i, kv, "="); $i = "RealMemory=" (kv[2] > 1024 ? kv[2] - 512 : kv[2]) } print}')
    [[ $node_line == NodeName=* ]] || die "unexpected 'slurmd -C' output: $node_line"
    node_line=${node_line/NodeName=* CPUs=/NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=}
    if [[ $want_acct == 1 ]]; then
        # With auth/munge, AccountingStoragePass names the munge socket used to reach slurmdbd.
        accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCKET"
    else
        accounting="AccountingStorageType=accounting_storage/none"
    fi
    cat >"$SLURM_CONF.new" <<EOF
# Written by scripts/slurm_local.sh: one node, no cgroups, everything under $BASE.
ClusterName=kpool
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays the restart of a requeued job (default 120 s)
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$accounting
JobCompType=jobcomp/none
MailProg=/bin/true
SchedulerType=sched/backfill
# a requeued job waits for its BeginTime; the backfill pass that starts it runs every 2 s, not 30 s
SchedulerParameters=bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=10
MinJobAge=600
InactiveLimit=0
$node_line
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    if cmp -s "$SLURM_CONF.new" "$SLURM_CONF"; then
        rm "$SLURM_CONF.new"
        CONF_CHANGED=0
    else
        mv "$SLURM_CONF.new" "$SLURM_CONF"
        CONF_CHANGED=1
    fi
}

start_munge() {
    if [[ ! -s $BASE/munge/munge.key ]]; then
        head -c 1024 /dev/urandom >"$BASE/munge/munge.key"
        chmod 400 "$BASE/munge/munge.key"
    fi
    if ! daemon_pid munged >/dev/null; then
        rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
        start_daemon munged munged --foreground --force --socket="$MUNGE_SOCKET" \
            --key-file="$BASE/munge/munge.key" --pid-file="$BASE/run/munged.pid" \
            --log-file="$BASE/log/munged.log" --seed-file="$BASE/munge/seed"
    fi
    wait_for 10 bash -c "munge -n -S '$MUNGE_SOCKET' | unmunge -S '$MUNGE_SOCKET'" \
        || die "munge does not answer; see $BASE/log/munged.out"
}

start_accounting() {
    if [[ ! -d $BASE/db/mysql ]]; then
        mariadb-install-db --no-defaults --datadir="$BASE/db" --user=root --skip-test-db \
            --auth-root-authentication-method=socket >"$BASE/log/mariadb-install.log" 2>&1 \
            || die "mariadb-install-db failed; see $BASE/log/mariadb-install.log"
    fi
    if ! daemon_pid mariadbd >/dev/null; then
        require_free_port mariadbd "$DB_PORT"
        start_daemon mariadbd mariadbd --no-defaults --user=root --datadir="$BASE/db" \
            --socket="$DB_SOCKET" --pid-file="$BASE/run/mariadbd.pid" --bind-address=127.0.0.1 \
            --port="$DB_PORT" --log-error="$BASE/log/mariadbd.err" --innodb-buffer-pool-size=64M
    fi
    wait_for 60 mariadb --no-defaults -S "$DB_SOCKET" -uroot -e 'select 1' \
        || die "MariaDB does not answer; see $BASE/log/mariadbd.err"
    mariadb --no-defaults -S "$DB_SOCKET" -uroot -e "
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
    # slurmdbd reads slurmdbd.conf next to $SLURM_CONF; it must be mode 600 and owned by SlurmUser.
    cat >"$BASE/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$BASE/run/slurmdbd.pid
LogFile=$BASE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$BASE/slurmdbd.conf"
    if ! daemon_pid slurmdbd >/dev/null; then
        require_free_port slurmdbd "$DBD_PORT"
        start_daemon slurmdbd slurmdbd -D
    fi
    wait_for 30 bash -c "ss -Hltn 'sport = :$DBD_PORT' | grep -q ." \
        || die "slurmdbd does not listen on $DBD_PORT; see $BASE/log/slurmdbd.log"
}

start_slurm() {
    if [[ $CONF_CHANGED == 1 ]] && { daemon_pid slurmctld || daemon_pid slurmd; } >/dev/null; then
        log "slurm.conf changed: restarting slurmctld and slurmd"
        stop_daemon slurmd
        stop_daemon slurmctld
    fi
    if ! daemon_pid slurmctld >/dev/null; then
        require_free_port slurmctld "$CTLD_PORT"
        start_daemon slurmctld slurmctld -D -f "$SLURM_CONF"
    fi
    wait_for 30 bash -c "scontrol ping | grep -q UP" \
        || die "slurmctld does not answer; see $BASE/log/slurmctld.log"
    if ! daemon_pid slurmd >/dev/null; then
        require_free_port slurmd "$SLURMD_PORT"
        start_daemon slurmd slurmd -D -f "$SLURM_CONF" -N "$NODE"
    fi
}

# Waits until the node accepts jobs; resumes it once if it came up drained/down.
wait_node_idle() {
    local state resumed=0 start=$SECONDS
    while ((SECONDS - start < WAIT_S)); do
        state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -1)
        case $state in
            idle | mixed | allocated | completing) return 0 ;;
            *drain* | *down* | *fail*)
                if [[ $resumed == 0 ]] && ((SECONDS - start > 3)); then
                    log "node is $state ($(sinfo -h -n "$NODE" -o %E)): resuming it"
                    scontrol update nodename="$NODE" state=resume || true
                    resumed=1
                fi
                ;;
        esac
        sleep 0.25
    done
    die "node $NODE is '${state:-unknown}' after ${WAIT_S}s; see $BASE/log/slurmd.log"
}

do_stop() {
    local jobs
    if daemon_pid slurmctld >/dev/null; then
        jobs=$(squeue -h -o %A 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            log "cancelling jobs: ${jobs//$'\n'/ }"
            # shellcheck disable=SC2086 # one job id per word
            scancel $jobs || true
            # shellcheck disable=SC2016 # expanded by the inner bash
            wait_for 20 bash -c '[[ -z $(squeue -h -o %A) ]]' || log "jobs still listed; stopping anyway"
        fi
    fi
    local d
    for d in slurmd slurmctld slurmdbd mariadbd munged; do stop_daemon "$d"; done
    log "stopped; state and logs stay in $BASE (rm -rf it to start from scratch)"
}

do_status() {
    local d pid
    for d in munged mariadbd slurmdbd slurmctld slurmd; do
        if pid=$(daemon_pid "$d"); then echo "$d: running (pid $pid)"; else echo "$d: not running"; fi
    done
    if daemon_pid slurmctld >/dev/null; then sinfo; squeue; fi
}

main() {
    local want_acct=0 action=start
    for arg in "$@"; do
        case $arg in
            --sacct) want_acct=1 ;;
            --stop) action=stop ;;
            --status) action=status ;;
            -h | --help) usage 0 ;;
            *) log "unknown argument: $arg"; usage 2 ;;
        esac
    done
    mkdir -p "$BASE"/{munge,state,spool,log,pids,run}
    case $action in
        stop) do_stop; return ;;
        status) do_status; return ;;
    esac

    local t0_ns t1_ns t2_ns
    t0_ns=$(date +%s%N)
    install_packages "$want_acct"
    t1_ns=$(date +%s%N)
    write_slurm_conf "$want_acct"
    start_munge
    if [[ $want_acct == 1 ]]; then start_accounting; else stop_daemon slurmdbd; stop_daemon mariadbd; fi
    start_slurm
    wait_node_idle
    t2_ns=$(date +%s%N)
    sinfo
    log "$(awk -v a="$t0_ns" -v b="$t1_ns" -v c="$t2_ns" \
        'BEGIN { printf "install %.1f s, start to idle %.1f s", (b - a) / 1e9, (c - b) / 1e9 }')"
    echo "export SLURM_CONF=$SLURM_CONF"
}

main "$@"
