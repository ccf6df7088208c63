#!/bin/bash
#SBATCH --job-name=flymc
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=1
#SBATCH --time=02:00:00
# FlyMC on a SLURM allocation: a Dask scheduler in one task, a single-threaded Dask
# worker in each other task, and the driver (`flymc run`) in this batch script.
#
#   sbatch deploy/slurm.sh STORE TRACE --model MODEL [more `flymc run` options]
#   sbatch deploy/slurm.sh /shared/data.zarr /shared/run.zarr --model logistic --samples 2000
#
# STORE and TRACE must be readable (STORE) and writable (TRACE) from every node: a shared
# file system, or s3://… URLs with --storage-option. The defaults are `flymc run`'s own
# (NUTS, MAP-tuned bounds, 4 chains); `flymc run --help` lists the options. A job cut
# short (time limit, lost node) keeps its trace to the last checkpoint: submit the same
# command again with --resume. FLYMC_INTERFACE=ib0 (say) puts Dask's and the rounds'
# traffic on that network interface.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: sbatch $0 STORE TRACE --model MODEL [flymc run options]" >&2
    exit 2
fi
STORE=$1
TRACE=$2
shift 2
WORKERS=$((SLURM_NTASKS - 1))
if [ "$WORKERS" -lt 1 ]; then
    echo "slurm.sh: needs at least 2 tasks (a scheduler and a worker)" >&2
    exit 2
fi
SCHED="${SLURM_SUBMIT_DIR:-$PWD}/scheduler-$SLURM_JOB_ID.json"
IFACE=()
if [ -n "${FLYMC_INTERFACE:-}" ]; then
    IFACE=(--interface "$FLYMC_INTERFACE")
fi
rm -f "$SCHED"
STEPS=()
cleanup() {
    # the scheduler's and workers' job steps end with the driver
    if [ ${#STEPS[@]} -gt 0 ]; then
        kill "${STEPS[@]}" 2>/dev/null || true
        wait "${STEPS[@]}" 2>/dev/null || true
    fi
    rm -f "$SCHED"
}
trap cleanup EXIT

srun --nodes=1 --ntasks=1 --overlap \
    dask scheduler --scheduler-file "$SCHED" --port 0 --no-dashboard "${IFACE[@]}" &
STEPS+=($!)
for _ in $(seq 300); do
    [ -f "$SCHED" ] && break
    sleep 1
done
if [ ! -f "$SCHED" ]; then
    echo "slurm.sh: the scheduler wrote no $SCHED in 300 s" >&2
    exit 1
fi
# one thread per worker: each shard's work is single-threaded
srun --ntasks="$WORKERS" --overlap \
    dask worker --scheduler-file "$SCHED" --nthreads 1 --no-dashboard "${IFACE[@]}" &
STEPS+=($!)
# place the shards once every worker is there (a run uses the workers it starts with)
python3 -c "import sys; from distributed import Client
with Client(scheduler_file=sys.argv[1], timeout=300) as c:
    c.wait_for_workers(int(sys.argv[2]), timeout=600)" "$SCHED" "$WORKERS"

flymc run "$STORE" --scheduler-file "$SCHED" --trace "$TRACE" --no-progress "$@"
