"""Taking what the pools leave (CUDA context, communicators, kernels, graphs) off the GPU.

Driven from outside the target: a process cannot lock or checkpoint itself.

    base       the Checkpointer interface, CUDA states, CheckpointStepError, step timeouts
    curesult   CUresult numbers, names and strings; identifying one from cuda-checkpoint's output
    driver     the driver API (cuCheckpointProcess*) through ctypes on libcuda.so.1
    binary     the cuda-checkpoint executable, one run per step
    detached   checkpoint and restore in a process of their own session: waited for, never cut
    driver_call  the driver's argument structs, and the small program that makes one such call
    selection  --checkpointer auto|driver|binary
    detect     which processes hold CUDA state (device files, or the driver answering)
    group      a group's checkpoint: lock all, checkpoint all; check memory, restore all, unlock all
    records    what each process held per GPU when checkpointed, for the wake's memory check
    nvml       GPUs, free and per-process memory, persistence and MIG mode (optional)
    room       what a wake will ask of each GPU, from what the sleep measured (pure)
    nccl       multi-process jobs and NCCL: the settings a checkpoint needs, from each environment
    helper     the child a vLLM worker starts to checkpoint itself (HIBERNATE_SELF_CHECKPOINT=1)

Every module here runs outside the process it acts on. The names below are the
package's face for code inside a target (:mod:`hibernate.integrations`), which
imports none of its modules.

Exit codes of the CUDA stage (the ``hibernate`` command's, see errors.ExitCode):

    6  WRONG_STATE       sleep of a process whose CUDA is already locked/checkpointed (wake it first)
    7  BUSY              another tool is checkpointing or restoring it
    10 TIMEOUT           a lock whose CUDA work did not drain in --timeout (the process runs on),
                         a driver call that never answered, or a checkpoint or restore past its
                         timeout, still running uncut in its own process (`hibernate recover`)
    11 CUDA_CHECKPOINT   a step failed (the message names the process, the step and the CUresult);
                         what was done was undone; also a sleep of a process in the failed state
    12 UNSUPPORTED       no checkpointer (no driver API, no usable cuda-checkpoint), a driver too
                         old, the driver cannot checkpoint this process (CUDA_ERROR_NOT_SUPPORTED),
                         or not enough free GPU memory to restore (nothing changed: retry later)
    13 NEEDS_RECOVERY    a restore ran out of GPU memory (the driver refuses later restores of
                         that process), an undo failed, or a wake of a process in the failed state
"""

# Set in the environment of hibernate's own helper processes: the pid each one serves (never taken
# for a CUDA holder of that process).
HELPER_ENV = "HIBERNATE_HELPER_OF"
