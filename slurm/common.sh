# Sourced by every omnihvd Slurm template when its job starts. Site-specific values
# live in site.sh; this file is the same everywhere.
#
# It reads site.sh, runs omnihvd_site_env (modules, Python environment), exports the
# per-rank thread count, and defines the helpers the templates call.

# This file's folder. (Templates find this file through OMNIHVD_SLURM_DIR, exported by
# submit.sh, or the submission folder: a batch script runs from a copy in Slurm's
# spool folder, so it cannot use its own path.)
OMNIHVD_SLURM_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OMNIHVD_ROOT="${OMNIHVD_ROOT:-$(dirname "$OMNIHVD_SLURM_DIR")}"
export OMNIHVD_SLURM_DIR OMNIHVD_ROOT
# shellcheck source=site.sh
source "$OMNIHVD_SLURM_DIR/site.sh"
omnihvd_site_env

# One compute thread per CPU Slurm gave the task; unbuffered output so the ranks'
# lines reach the log as they are printed.
export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"
export PYTHONUNBUFFERED=1

# Exit status by which train_job.py says "checkpoint written, run me again".
OMNIHVD_REQUEUE_EXIT=85

# omnihvd_banner STYLE: one line naming the job, its nodes and the launch style.
omnihvd_banner() {
    echo "omnihvd-slurm: job=${SLURM_JOB_ID} name=${SLURM_JOB_NAME} style=$1" \
        "nodes=${SLURM_JOB_NODELIST} tasks=${SLURM_NTASKS:-?}" \
        "restart=${SLURM_RESTART_COUNT:-0} python=$(command -v python)"
}

# omnihvd_tasks_per_node: one line per allocated node with its task count, expanding
# Slurm's compressed SLURM_TASKS_PER_NODE ("2(x3),1" -> 2 2 2 1).
omnihvd_tasks_per_node() {
    local item i
    for item in ${SLURM_TASKS_PER_NODE//,/ }; do
        if [[ $item =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
            for ((i = 0; i < BASH_REMATCH[2]; i++)); do echo "${BASH_REMATCH[1]}"; done
        else
            echo "$item"
        fi
    done
}

# omnihvd_horovod_hosts: the allocation as horovodrun's -H list ("node:slots,...").
# horovodrun does not read the Slurm allocation, so the list is built from
# SLURM_JOB_NODELIST (expanded by scontrol) and SLURM_TASKS_PER_NODE.
omnihvd_horovod_hosts() {
    local -a nodes counts hosts=()
    local i
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    mapfile -t counts < <(omnihvd_tasks_per_node)
    if [ "${#nodes[@]}" -ne "${#counts[@]}" ]; then
        echo "omnihvd_horovod_hosts: ${#nodes[@]} nodes but ${#counts[@]} task counts" \
            "(SLURM_TASKS_PER_NODE=$SLURM_TASKS_PER_NODE)" >&2
        return 1
    fi
    for i in "${!nodes[@]}"; do hosts+=("${nodes[$i]}:${counts[$i]}"); done
    (IFS=,; echo "${hosts[*]}")
}

# omnihvd_master_addr: the address of the allocation's first node, where torchrun's
# rendezvous runs (slurm/torchrun.sbatch). Slurm's NodeAddr, which is the host name on
# most clusters and whatever Slurm itself uses to reach the node otherwise.
omnihvd_master_addr() {
    local first addr
    first="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    if [ -z "$first" ]; then
        echo "omnihvd_master_addr: no node in SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}'" >&2
        return 1
    fi
    addr="$(scontrol show node "$first" -o 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')"
    echo "${addr:-$first}"
}

# omnihvd_het_late_exit: the bash program that hetjob.sbatch wraps around the
# training command of its second component: run "$@", wait
# OMNIHVD_HET_EXIT_STAGGER seconds (site.sh), exit with the command's status.
#
# Why: srun of Slurm 22.05 (Debian 12's) starts and stops the mpi/pmix "abort agent"
# once per component of a heterogeneous step, from one thread per component, with no
# lock (pmixp_abort_agent_stop: if (tid) { shutdown; pthread_join(tid); tid = 0; }).
# The components of one MPI world end together, so the two stops often run within
# milliseconds of each other; both then join the same thread and, now and then,
# srun waits for ever after every task has exited (seen here in about 1 job in 30:
# the job sat RUNNING until the test's timeout). Slurm's current source guards the
# agent with a mutex and a start count; 22.05.8 does not. Ending component 1 a few
# seconds later puts its stop after component 0's. That makes the hang rarer at
# best: one hung with the components 3 s apart, its second stop joining a thread the
# first had already joined (docs/slurm.rst). The wrapper traps USR1, USR2 and TERM only so
# that bash survives them: Slurm signals every process of a task, so the training
# script gets them itself (the checkpoint signal, scancel).
omnihvd_het_late_exit() {
    # shellcheck disable=SC2016  # the program is expanded by the task's bash
    printf '%s' 'trap : USR1 USR2 TERM; "$@"; status=$?; sleep '"${OMNIHVD_HET_EXIT_STAGGER:-3}"'; exit $status'
}

# omnihvd_finish STATUS: end the batch script after the training step. STATUS
# OMNIHVD_REQUEUE_EXIT means the job checkpointed on the time-limit signal: put it
# back in the queue (it restarts with SLURM_RESTART_COUNT+1 and resumes from the
# checkpoint). Any other status is the job's exit status.
omnihvd_finish() {
    local status="$1"
    if [ "$status" -eq "$OMNIHVD_REQUEUE_EXIT" ]; then
        echo "omnihvd-slurm: checkpoint written; requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    echo "omnihvd-slurm: training step exited with status $status"
    exit "$status"
}
