#!/usr/bin/env bash
# SLURM on loopback: starts munged, slurmctld and slurmd (Debian's slurm-wlm 22.05 and munge) as a one-node
# cluster with 2 CPUs and 2 fake GPUs, listening on 127.0.0.1 only, and submits end_to_end/gpu/train_slurm.sbatch
# unchanged but for sbatch options and hardware=cpu: 2 tasks of 4 simulated CPU devices with
# dcn_data_parallelism=2 (mesh data=2 x fsdp=4). Its per-step losses must match a single process on 8 devices
# with the same mesh (ici_data_parallelism=2) to a relative 1e-5. Daemons, jobs and the work directory are
# removed on exit; the check fails if any of our processes listened beyond 127.0.0.0/8.
#   apt-get install -y --no-install-recommends slurm-wlm munge     (once; run this script as root)
#   bash end_to_end/slurm_loopback.sh          (about 60 s on 2 CPU cores; KEEP=1 keeps the work directory)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TOL=1e-5  # float32; the two runs sum gradients in a different order (gloo across processes vs one process).

for tool in munged mungekey slurmctld slurmd sbatch sinfo squeue scancel ss timeout; do
  if ! command -v "$tool" >/dev/null; then
    echo "error: $tool not found; apt-get install -y --no-install-recommends slurm-wlm munge iproute2" >&2
    exit 2
  fi
done
if [[ $(id -u) != 0 ]]; then
  echo "error: run as root: slurmd starts job steps as the submitting user, which needs root" >&2
  exit 2
fi

unset "${!SLURM_@}"  # Run inside a real SLURM job, we must not join it.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/slurm_loopback.XXXXXX")
chmod 711 "$WORK"
mkdir -p "$WORK"/{etc,munge,state,spool,log,run,gpu,runs}
export SLURM_CONF=$WORK/etc/slurm.conf
daemons=()  # PIDs of what we start, in start order.
watcher=""
start_time=$SECONDS

show_logs() {
  local f
  for f in "$WORK"/log/*; do
    echo "--- last lines of $f" >&2
    tail -n 15 "$f" >&2
  done
}

cleanup() {
  local rc=$? pid i t queued
  set +e
  [[ -n "$watcher" ]] && kill "$watcher" 2>/dev/null
  if [[ ${#daemons[@]} -gt 1 ]]; then  # The controller was started: end our jobs before the daemons.
    mapfile -t queued < <(timeout 10 squeue -h -o %i 2>/dev/null)
    if [[ ${#queued[@]} -gt 0 ]]; then
      timeout 10 scancel "${queued[@]}"
      for ((i = 0; i < 60; i++)); do
        [[ -z "$(timeout 10 squeue -h -o %i 2>/dev/null)" ]] && break
        sleep 0.5
      done
    fi
  fi
  for ((i = ${#daemons[@]} - 1; i >= 0; i--)); do
    pid=${daemons[i]}
    kill "$pid" 2>/dev/null
    for ((t = 0; t < 20; t++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  if [[ "${KEEP:-0}" == 1 ]]; then
    echo "kept $WORK"
  else
    rm -rf "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_until() {  # wait_until SECONDS WHAT COMMAND...: polls COMMAND twice a second, fails after SECONDS.
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      echo "error: no $what after $1 s" >&2
      show_logs
      return 1
    fi
    sleep 0.5
  done
}

# Every second, appends to listeners.txt the TCP listeners of our processes: those whose environment has our
# SLURM_CONF (the daemons, job steps, srun, and both training runs).
watch_listeners() {
  local line pid pids
  while sleep 1; do
    while read -r line; do
      mapfile -t pids < <(grep -o 'pid=[0-9]*' <<<"$line" | cut -d= -f2)
      for pid in "${pids[@]}"; do
        if grep -qzxF "SLURM_CONF=$SLURM_CONF" "/proc/$pid/environ" 2>/dev/null; then
          awk '{print $4, $6}' <<<"$line" >>"$WORK/listeners.txt"
          break
        fi
      done
    done < <(ss -Hltnp)
  done
}

read -r ctld_port slurmd_port jax_port < <(
  "$PYTHON" -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
  s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))'
)

# munge authenticates every SLURM message; a key and a socket of our own leave any system munged alone.
mungekey --create --bits=1024 --keyfile="$WORK/munge/munge.key"
touch "$WORK/listeners.txt"
watch_listeners &
watcher=$!
munged --foreground --force --socket="$WORK/munge/munge.socket" --key-file="$WORK/munge/munge.key" \
  --pid-file="$WORK/run/munged.pid" --seed-file="$WORK/munge/seed" --log-file="$WORK/log/munged.log" \
  >"$WORK/log/munged.out" 2>&1 &
daemons+=($!)
wait_until 10 "munge socket" test -S "$WORK/munge/munge.socket"

# slurmd accepts only character or block devices as GPU files and sets CUDA_VISIBLE_DEVICES from their
# order; two links to /dev/null and /dev/zero stand in for /dev/nvidia0 and /dev/nvidia1.
ln -s /dev/null "$WORK/gpu/nvidia0"
ln -s /dev/zero "$WORK/gpu/nvidia1"
cat >"$WORK/etc/gres.conf" <<EOF
AutoDetect=off
NodeName=localhost Name=gpu File=$WORK/gpu/nvidia[0-1]
EOF
touch "$WORK/etc/plugstack.conf"
# NoCtldInAddrAny / NoInAddrAny: slurmctld, slurmd and srun bind 127.0.0.1 (the address localhost and
# NodeAddr resolve to) instead of every interface. No cgroups: tasks are tracked through /proc.
cat >"$SLURM_CONF" <<EOF
ClusterName=loopback
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$WORK/munge/munge.socket
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/run/slurmctld.pid
SlurmdPidFile=$WORK/run/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
PlugStackConfig=$WORK/etc/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=60 State=UP
EOF
slurmctld -D -f "$SLURM_CONF" >"$WORK/log/slurmctld.out" 2>&1 &
daemons+=($!)
slurmd -D -N localhost -f "$SLURM_CONF" >"$WORK/log/slurmd.out" 2>&1 &
daemons+=($!)
node_idle() { [[ "$(sinfo -h -n localhost -o %T)" == idle ]]; }
wait_until 60 "idle node" node_idle
echo "SLURM up on 127.0.0.1 (slurmctld :$ctld_port, slurmd :$slurmd_port) after $((SECONDS - start_time)) s"

# The job shape the training job gets, and the variables srun sets in it.
sbatch_opts=(--nodes=1 --ntasks-per-node=2 --gpus-per-node=2 --exclusive --mem=0 --time=15)
timeout 120 sbatch --wait --quiet "${sbatch_opts[@]}" --output="$WORK/env.out" --wrap="srun --label env"
for rank in 0 1; do
  sed -n "s/^$rank: //p" "$WORK/env.out" | grep -E '^(SLURM_|CUDA_VISIBLE_DEVICES=)' | sort >"$WORK/env.$rank"
done
echo "Variables srun set in task 0 (of 2, with 2 fake GPUs):"
sed 's/^/  /' "$WORK/env.0"
echo "Task 1 differs in:"
comm -13 "$WORK/env.0" "$WORK/env.1" | sed 's/^/  /'
for rank in 0 1; do
  for var in SLURM_JOB_ID SLURM_STEP_NODELIST SLURM_NTASKS SLURM_PROCID SLURM_LOCALID; do
    grep -q "^$rank: $var=" "$WORK/env.out" || { echo "error: task $rank has no $var" >&2 && exit 1; }
  done
  grep -qx "$rank: CUDA_VISIBLE_DEVICES=0,1" "$WORK/env.out" || { echo "error: task $rank does not see both GPUs" >&2 && exit 1; }
done

common=(hardware=cpu model_name=tiny dataset_type=synthetic steps=4 enable_checkpointing=false log_config=false
  base_output_directory="$WORK/runs")
t0=$SECONDS
XLA_FLAGS=--xla_force_host_platform_device_count=8 timeout 600 "$PYTHON" MaxText/train.py MaxText/configs/base.yml \
  run_name=reference "${common[@]}" ici_data_parallelism=2 metrics_file="$WORK/reference.jsonl" >"$WORK/reference.out" 2>&1 \
  || { tail -n 30 "$WORK/reference.out" >&2 && echo "error: the reference run failed" >&2 && exit 1; }
echo "reference run (1 process, 8 devices): $((SECONDS - t0)) s"

t0=$SECONDS
if ! XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_COORDINATOR_PORT=$jax_port PYTHON=$PYTHON timeout 600 \
  sbatch --wait --quiet "${sbatch_opts[@]}" --job-name=loopback --output="$WORK/slurm.out" \
  end_to_end/gpu/train_slurm.sbatch run_name=slurm "${common[@]}" dcn_data_parallelism=2 metrics_file="$WORK/slurm.jsonl"; then
  tail -n 40 "$WORK/slurm.out" >&2
  echo "error: the SLURM job failed" >&2
  exit 1
fi
echo "SLURM job (2 tasks x 4 devices): $((SECONDS - t0)) s; its log:"
grep -vE '\[Gloo\]|connected to [0-9]+ peer ranks' "$WORK/slurm.out" | sed 's/^/  /'  # Gloo's chatter, interleaved.

kill "$watcher"
watcher=""
echo "TCP listeners of our processes (address, process):"
sort -u "$WORK/listeners.txt" | sed 's/^/  /'
if sort -u "$WORK/listeners.txt" | awk '{print $1}' | grep -vqE '^(127\.[0-9.]+|\[::1\]|\[::ffff:127\.[0-9.]+\]):[0-9]+$'; then
  echo "error: a listener above is not on loopback" >&2
  exit 1
fi

"$PYTHON" - "$WORK" "$TOL" <<'PY'
import json, sys
from MaxText import cli
work, tol = sys.argv[1], float(sys.argv[2])
resolved = cli.read_derived(open(f"{work}/runs/slurm/config.yml").read())
if (resolved["num_devices"], resolved["num_slices"]) != (8, 2):
  sys.exit(f"error: the SLURM job ran on {resolved['num_devices']} devices in {resolved['num_slices']} slices, not 8 in 2")
def losses(name):
  return {r["step"]: r["learning/loss"] for r in map(json.loads, open(f"{work}/{name}.jsonl")) if "learning/loss" in r}
ref, got = losses("reference"), losses("slurm")
if sorted(ref) != sorted(got) or len(ref) != 4:
  sys.exit(f"error: steps differ: reference {sorted(ref)}, SLURM {sorted(got)}")
worst = 0.0
print("step  reference (1 x 8)  SLURM (2 x 4)  relative difference")
for step in sorted(ref):
  rel = abs(got[step] - ref[step]) / abs(ref[step])
  worst = max(worst, rel)
  print(f"{step:4d}  {ref[step]:17.7f}  {got[step]:13.7f}  {rel:.1e}")
print(f"largest relative difference {worst:.1e} (tolerance {tol:.0e})")
sys.exit(0 if worst <= tol else 1)
PY
echo "PASS in $((SECONDS - start_time)) s"
