# Sourced by the sbatch scripts of this folder: run the training command so that Slurm's warning
# signal reaches it and a stopped run is requeued (docs/scale-out.md, docs/reliability.md).
#
# `#SBATCH --signal=B:TERM@120` sends SIGTERM to this batch shell 120 s before the time limit.
# A batch shell does not pass signals on by itself, so the command runs in the background and the
# trap below forwards SIGTERM to it (srun forwards it to its tasks: torchrun, which forwards it to
# the ranks). Our commands then finish the step, save a checkpoint and exit 143 ("stopped by
# SIGTERM after step N"); 0 is a finished run (or `train.exit_duration_mins`), 2 a user error
# (bad recipe, data, checkpoint: requeueing cannot help), 1 a failure. Under torchrun the exit
# status is torchrun's (not 143: it re-raises the signal as an error), so the decision to requeue
# is "SIGTERM arrived and the run did not end with 0 or 2". The requeued job runs the same command,
# which resumes from the newest complete checkpoint under checkpoint.save (shared storage).

# run_requeueable COMMAND...: run COMMAND, forward SIGTERM to it, requeue this job when SIGTERM
# stopped it; returns COMMAND's exit status.
run_requeueable() {
    local got_term=0 rc pid
    "$@" &
    pid=$!
    trap 'got_term=1; kill -TERM "$pid" 2>/dev/null' TERM
    while true; do
        wait "$pid"
        rc=$?
        kill -0 "$pid" 2>/dev/null || break # wait returned because of the trap: the command still runs
    done
    trap - TERM
    if [ "$got_term" = 1 ] && [ "$rc" != 0 ] && [ "$rc" != 2 ]; then
        echo "stopped by SIGTERM (exit $rc): requeueing job ${SLURM_JOB_ID}; it resumes from the newest complete checkpoint" >&2
        # Slurm's own preemption (PreemptMode=REQUEUE) may have requeued it already.
        scontrol requeue "${SLURM_JOB_ID}" || true
    fi
    return "$rc"
}

# first_node: the first host of the allocation (the c10d rendezvous and the Ray head live there).
first_node() {
    scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1
}
