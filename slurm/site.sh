# omnihvd Slurm site settings: the ONE file to edit for your cluster.
#
# Read by slurm/submit.sh (partitions, account, log folder) when it submits a
# template, and by every template (modules, environment) when the job starts. Each
# setting keeps a value already in the environment, so one submission can override
# it: OMNIHVD_PARTITION=debug slurm/submit.sh slurm/single_node.sbatch
#
# Lines to edit are marked EDIT.

# Partition for jobs on one node type ("" = the cluster's default partition). EDIT
OMNIHVD_PARTITION="${OMNIHVD_PARTITION-}"

# The two partitions (node types) of slurm/hetjob.sbatch: component 0 runs on the
# first, component 1 on the second, e.g. "gpu-a100 gpu-v100" or "gpu cpu" ("" = the
# --partition lines of the template itself). EDIT
OMNIHVD_HET_PARTITIONS="${OMNIHVD_HET_PARTITIONS-}"

# slurm/hetjob.sbatch: seconds srun may take to return once every task of the
# heterogeneous step has exited; then it is killed (an srun hang of Slurm 22.05,
# slurm/common.sh, omnihvd_het_srun). Whole seconds; 0 waits for srun without a bound. The task
# status files go to OMNIHVD_HET_STATUS_DIR, which every node must see (default: a
# folder per job in OMNIHVD_LOG_DIR).
OMNIHVD_HET_SRUN_GRACE="${OMNIHVD_HET_SRUN_GRACE-30}"

# Account to charge ("" = your default account). EDIT
OMNIHVD_ACCOUNT="${OMNIHVD_ACCOUNT-}"

# Where job logs go (named JOBNAME-JOBID.out) and where checkpoints are written.
# Both must be on a file system that every node sees. EDIT
OMNIHVD_LOG_DIR="${OMNIHVD_LOG_DIR-$OMNIHVD_ROOT/logs}"
OMNIHVD_CKPT_DIR="${OMNIHVD_CKPT_DIR-$OMNIHVD_ROOT/checkpoints}"

# Runs at the start of every job, before the launch: load modules and activate the
# Python environment that has torch, horovod and omnihvd. End each line with
# "|| return 1": a failure then ends the job at once with a message (only the last
# command's status would count otherwise). EDIT
omnihvd_site_env() {
    # module purge || return 1
    # module load openmpi/4.1 cuda/12.1 || return 1   # the MPI horovod was built with
    # shellcheck disable=SC1091
    source "$OMNIHVD_ROOT/.venv/bin/activate" || return 1   # or: conda activate omnihvd
}
