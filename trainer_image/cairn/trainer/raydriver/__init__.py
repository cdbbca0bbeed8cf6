"""Ray driver: the ranks of a training job as Ray actors (docs/ray-driver.md).

    python -m cairn.trainer.raydriver [options] MODULE:FUNCTION -- ARGS...

runs `FUNCTION(ARGS)` in one rank actor per rank (`nodes * procsPerNode`,
one placement-group bundle per rank) with the env torchrun would give
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT of rank 0's actor, the pod's
CAIRN_* vars), so `cairn.trainer.reference:main` runs unchanged. Checkpoint
commits go through the named `CheckpointMonitor` actor; a dead rank actor on
healthy nodes is replaced in place by a new group (fenced by generation),
within a budget; SIGTERM of the driver asks every rank for the final
checkpoint. Modules: `cli` (arguments, entry point), `driver` (the loop),
`rank` (the rank actor), `placement` and `recovery` (pure decisions),
`status` (status.ray in the API).
"""
