#!/bin/bash
#SBATCH --job-name=flymc
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=1
#SBATCH --time=02:00:00
# Usage: sbatch deploy/slurm.sh /shared/data.zarr /shared/trace.zarr
set -euo pipefail
STORE=$1
TRACE=$2
SCHED=$PWD/scheduler-$SLURM_JOB_ID.json
srun --nodes=1 --ntasks=1 dask scheduler --scheduler-file "$SCHED" --no-dashboard &
while [ ! -f "$SCHED" ]; do sleep 1; done
srun --ntasks=$((SLURM_NTASKS - 1)) dask worker --scheduler-file "$SCHED" --nthreads 1 --no-dashboard &
flymc run "$STORE" --model robust --prior laplace --algorithm flymc --bounds map \
    --kernel slice --scheduler-file "$SCHED" --trace "$TRACE" --no-progress
