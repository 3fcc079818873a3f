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
# A site set-up that fails (a missing module or environment) ends the job here, not
# in four ranks failing to start (or running whichever python is on PATH). Its
# lines end in "|| return 1" (site.sh), since only the last command's status would
# count; it runs without set -u, which conda's and some modules' activation
# scripts do not survive.
case $- in *u*) nounset=1 ;; *) nounset= ;; esac
set +u
omnihvd_site_env
site_status=$?
[ -n "$nounset" ] && set -u
if [ "$site_status" -ne 0 ]; then
    echo "omnihvd-slurm: omnihvd_site_env failed (slurm/site.sh): fix the modules and" \
        "Python environment it loads (OMNIHVD_ROOT=$OMNIHVD_ROOT)" >&2
    exit 1
fi

# The environment just set up (PATH, the threads below) must reach the tasks: a site
# that submits with --export=NONE (SBATCH_EXPORT=NONE) leaves SLURM_EXPORT_ENV=NONE
# here, and srun would then start every task without it.
export SLURM_EXPORT_ENV=ALL

# One compute thread per CPU Slurm gave the task; unbuffered output so the ranks'
# lines reach the log as they are printed. srun (22.05 on) does not take
# --cpus-per-task from the allocation: SRUN_CPUS_PER_TASK passes it on.
export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi
export PYTHONUNBUFFERED=1

# Exit status by which train_job.py says "checkpoint written, run me again".
OMNIHVD_REQUEUE_EXIT=85

# omnihvd_banner STYLE: one line naming the job, its nodes and the launch style.
omnihvd_banner() {
    local tasks="${SLURM_NTASKS:-?}"
    if [ -n "${SLURM_HET_SIZE:-}" ]; then   # a hetjob: SLURM_NTASKS is component 0's
        tasks=$(( ${SLURM_NTASKS_HET_GROUP_0:-0} + ${SLURM_NTASKS_HET_GROUP_1:-0} ))
    fi
    echo "omnihvd-slurm: job=${SLURM_JOB_ID} name=${SLURM_JOB_NAME} style=$1" \
        "nodes=${SLURM_JOB_NODELIST} tasks=$tasks" \
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

# omnihvd_node_addr NODE: Slurm's NodeAddr of NODE -- the host name on most clusters,
# whatever Slurm itself uses to reach the node otherwise -- or NODE when unknown.
omnihvd_node_addr() {
    local addr
    addr="$(scontrol show node "$1" -o 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')"
    echo "${addr:-$1}"
}

# omnihvd_horovod_hosts: the allocation as horovodrun's -H list ("node:slots,...").
# horovodrun does not read the Slurm allocation, so the list is built from
# SLURM_JOB_NODELIST (expanded by scontrol) and SLURM_TASKS_PER_NODE. horovodrun
# reaches the nodes by ssh under these names: Slurm's node names, which are the host
# names on most clusters (where they are not, NodeAddr is what ssh needs).
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
    local first
    first="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    if [ -z "$first" ]; then
        echo "omnihvd_master_addr: no node in SLURM_JOB_NODELIST='${SLURM_JOB_NODELIST:-}'" >&2
        return 1
    fi
    omnihvd_node_addr "$first"
}

# omnihvd_het_task: the bash program that hetjob.sbatch wraps around the training
# command of every task of its heterogeneous step: run "$@", leave "STATUS NTASKS" in
# OMNIHVD_HET_STATUS_DIR/task.PROCID, exit with the command's status. The wrapper
# traps USR1, USR2 and TERM only so that bash survives them and still writes the
# file: Slurm signals every process of a task, so the training script gets them
# itself (the checkpoint signal, scancel, --kill-on-bad-exit).
omnihvd_het_task() {
    # shellcheck disable=SC2016  # the program is expanded by the task's bash
    printf '%s' 'trap : USR1 USR2 TERM; "$@"; status=$?
d="$OMNIHVD_HET_STATUS_DIR"
echo "$status $SLURM_NTASKS" > "$d/.task.$SLURM_PROCID" && mv "$d/.task.$SLURM_PROCID" "$d/task.$SLURM_PROCID"
exit $status'
}

# omnihvd_het_srun SRUN-ARGS...: run the heterogeneous step "srun SRUN-ARGS..."
# (every task under omnihvd_het_task) and return its exit status, with a bound on
# one known hang. srun of Slurm 22.05 (Debian 12's) stops the mpi/pmix abort agent
# once per component; the second stop joins the thread the first already joined,
# and now and then that join never returns: srun then waits for ever after every
# task has exited (here about one job in 30 once, none in a later 60; gdb's
# backtrace and the counts in docs/slurm.rst).
# So: once every task has left its status, srun gets OMNIHVD_HET_SRUN_GRACE seconds
# (site.sh) to return; after that it is killed, and the step's status is the highest
# task status (what srun itself returns). A task killed before it could write (say,
# SIGKILL after KillWait) leaves the wait unbounded, as without this helper.
omnihvd_het_srun() {
    local dir="${OMNIHVD_HET_STATUS_DIR:?omnihvd_het_srun: set OMNIHVD_HET_STATUS_DIR}"
    local grace="${OMNIHVD_HET_SRUN_GRACE:-30}"
    local pid all_done="" total status worst f
    local -a files
    case "$grace" in
        *[!0-9]*|"")
            echo "omnihvd-slurm: OMNIHVD_HET_SRUN_GRACE must be whole seconds" \
                "(0: no bound), not '$grace'" >&2
            return 2 ;;
    esac
    grace=$((10#$grace))   # "08" is eight seconds, not a bad octal number
    mkdir -p "$dir" && rm -f "$dir"/task.*
    srun "$@" &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        files=("$dir"/task.*)
        [ -e "${files[0]}" ] && read -r _ total < "${files[0]}" || total=""
        if [ -z "$total" ] || [ "${#files[@]}" -lt "$total" ] || [ "$grace" -le 0 ]; then
            continue
        fi
        all_done="${all_done:-$SECONDS}"
        if (( SECONDS - all_done >= grace )); then
            worst=0
            for f in "${files[@]}"; do
                read -r status _ < "$f"
                (( status > worst )) && worst=$status
            done
            echo "omnihvd-slurm: srun had not returned ${grace} s after all $total tasks" \
                "exited (the Slurm 22.05 het-step hang, docs/slurm.rst): killed it;" \
                "highest task status $worst"
            kill -KILL "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
            rm -f "$dir"/task.*; rmdir "$dir" 2>/dev/null
            return "$worst"
        fi
    done
    wait "$pid"
    status=$?
    rm -f "$dir"/task.*; rmdir "$dir" 2>/dev/null
    return "$status"
}

# omnihvd_finish STATUS: end the batch script after the training step. STATUS
# OMNIHVD_REQUEUE_EXIT means the job checkpointed on the time-limit signal: put it
# back in the queue (it restarts with SLURM_RESTART_COUNT+1 and resumes from the
# checkpoint). Any other status is the job's exit status.
omnihvd_finish() {
    local status="$1"
    if [ "$status" -eq "$OMNIHVD_REQUEUE_EXIT" ]; then
        echo "omnihvd-slurm: checkpoint written; requeueing job $SLURM_JOB_ID"
        if ! scontrol requeue "$SLURM_JOB_ID"; then
            # e.g. submitted with --no-requeue, or a site that disables it: the job
            # stopped part-way, which is not a success
            echo "omnihvd-slurm: Slurm refused to requeue job $SLURM_JOB_ID; training" \
                "stopped at its checkpoint (kept, named above): resubmit with the training" \
                "script's --resume CHECKPOINT to go on" >&2
            exit "$OMNIHVD_REQUEUE_EXIT"
        fi
        exit 0
    fi
    echo "omnihvd-slurm: training step exited with status $status"
    exit "$status"
}
