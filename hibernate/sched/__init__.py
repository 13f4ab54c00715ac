"""What batch schedulers use: selecting a job's processes, one node's step of a job, signals.

    selectors  --all, --job ID (Slurm), --cgroup PATH: the processes a scheduler's script means
    cgroups    reading the cgroup filesystem, as every scheduler lays it out
    slurm      what is Slurm's own: its jobs' cgroups and environment, slurmstepd, srun's node
               numbering, the shell scripts; another scheduler would be a module beside it
    barrier    the file-based barrier through which the nodes of a job agree on one verdict
    nodestep   ``hibernate node-step``: one node's sleep or wake of a job that spans nodes
    runner     ``hibernate run --on-signal``: a job hibernated on the scheduler's warning signal

All of it runs outside the targets, loaded only by the commands that need it.
"""
