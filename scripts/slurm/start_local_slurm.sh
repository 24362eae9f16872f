#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, from Debian's packages, for running datatrove's
# SlurmPipelineExecutor for real (tests/test_score_pipeline.py; docs/cache.md). Run as root:
#
#   bash scripts/slurm/start_local_slurm.sh
#
# Installs slurmctld, slurmd, slurm-client and munge if missing (apt-get), writes a minimal
# /etc/slurm/slurm.conf for this host with its real CPU count and memory (one partition, "debug"),
# starts munged, slurmctld and slurmd, and waits until `sinfo` shows the node idle. Idempotent: a
# cluster already up is left as it is; a slurm.conf not written by this script is never replaced.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
  echo "start_local_slurm.sh: run it as root (it installs packages and starts daemons)" >&2
  exit 1
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
  || ! command -v sinfo >/dev/null; then
  echo "+ apt-get install slurmctld slurmd slurm-client munge"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi

node="$(hostname -s)"
cpus="$(nproc)"
# slurmd refuses a node that claims more memory than it has: a little under the real total
memory_mb="$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.95}' /proc/meminfo)"
conf=/etc/slurm/slurm.conf
marker="# written by longppl's scripts/slurm/start_local_slurm.sh"
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
if [ -f "$conf" ] && ! grep -qF "$marker" "$conf"; then
  echo "start_local_slurm.sh: $conf exists and was not written by this script; leaving it (and the cluster) as they are" >&2
else
  cat >"$conf.new" <<EOF
$marker
ClusterName=local
SlurmctldHost=$node
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmUser=root
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmdTimeout=30
Waittime=0
NodeName=$node CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  if ! cmp -s "$conf.new" "$conf" 2>/dev/null; then mv "$conf.new" "$conf"; else rm -f "$conf.new"; fi
fi

# munge: a key (Debian's package creates one; make one if it is missing), owned by its user
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || su -s /bin/sh munge -c /usr/sbin/munged
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd

for _ in $(seq 1 60); do
  state="$(sinfo -h -N -n "$node" -o %t 2>/dev/null || true)"
  case "$state" in
    idle|mix|alloc) echo "slurm is up: node $node ($cpus CPUs, $memory_mb MB) is $state"; exit 0 ;;
    down*|drain*) scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 1
done
echo "start_local_slurm.sh: the node $node did not become idle in 60 s (sinfo: ${state:-no answer});" \
  "see /var/log/slurm/slurmctld.log and slurmd.log" >&2
exit 1
