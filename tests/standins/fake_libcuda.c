/*
 * STAND-IN for tests only: a fake libcuda.so.1 with the CUDA checkpoint API.
 *
 * Exports what hibernate's driver checkpointer calls (cuDriverGetVersion,
 * cuInit, cuGetErrorName/String, cuCheckpointProcess{Lock,Checkpoint,Restore,
 * Unlock,GetState,GetRestoreThreadId}) with the real signatures, argument
 * structs (64 bytes, reserved fields must be zero), CUresult values, strings
 * and transitions:
 *
 *   running --lock--> locked --checkpoint--> checkpointed --restore--> locked --unlock--> running
 *
 * A wrong-state call fails with CUDA_ERROR_ILLEGAL_STATE; a lock that times
 * out fails with CUDA_ERROR_NOT_READY and leaves the process running; a
 * restore needs cuInit(0) in the caller or persistence mode; a restore
 * without enough free GPU memory fails with CUDA_ERROR_OUT_OF_MEMORY, leaves
 * the process checkpointed, and every later restore of it fails with
 * CUDA_ERROR_OPERATING_SYSTEM (NVIDIA/cuda-checkpoint#44); the gpuPairs of
 * CUDA 13.0 must name every checkpointed GPU. A pid that is not registered
 * (or does not exist) gets CUDA_ERROR_INVALID_VALUE; another user's process
 * CUDA_ERROR_NOT_PERMITTED.
 *
 * Built with -DSTANDIN_NO_CHECKPOINT_API it has no cuCheckpoint* symbols, as
 * the libcuda of a driver older than 570. cuGetExportTable hands the fake
 * cuda-checkpoint binary the same operations (the real binary, a stub, also
 * imports only cuDriverGetVersion and cuGetExportTable).
 *
 * A checkpoint or restore held by the test (hold-<STEP>-<PID> in the world)
 * is in progress until released: the process answers checkpointing or
 * restoring meanwhile, and if its caller dies before the call ends (a command
 * killed, or exiting, in the middle of it) the process is in the failed state
 * for good, as a real cut checkpoint or restore can leave it.
 *
 * $HIBERNATE_STANDIN_CUDA_VERSION sets what cuDriverGetVersion reports (default 13000).
 */
#include <stdint.h>

#include "standin_world.h"
#include "standin_table.h"

static int initialized = 0;

static int standin_version(void) {
    const char *v = getenv("HIBERNATE_STANDIN_CUDA_VERSION");
    return (v && *v) ? atoi(v) : 13000;
}

int cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = standin_version();
    return CUDA_SUCCESS;
}

static CUresult standin_init(const char *caller) {
    int code = CUDA_SUCCESS;
    standin_gpu gpus[MAX_GPUS];
    if (standin_fault("init", 0, &code) == FAULT_NONE) {
        code = standin_load_gpus(gpus) > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
    }
    if (code == CUDA_SUCCESS) initialized = 1;
    standin_log(caller, "init", 0, code);
    return code;
}

CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    return standin_init("driver");
}

CUresult cuGetErrorName(CUresult error, const char **out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    *out = standin_error_name(error);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    *out = standin_error_text(error);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static int owner_allows(int pid) {
    char path[64];
    struct stat st;
    snprintf(path, sizeof path, "/proc/%d", pid);
    if (stat(path, &st) != 0) return 1;
    return geteuid() == 0 || st.st_uid == geteuid();
}

/* A checkpoint or restore the test holds: marked in progress, the world unlocked meanwhile (others may
 * ask the state), until the hold is released; then the world is locked again and the process reread.
 * Returns the world's lock. A caller killed while it waits never comes back here: the mark stays. */
static int standin_hold(int world, const char *step, int pid, standin_proc *p) {
    standin_mark_busy(pid, step);
    standin_unlock(world);
    while (standin_held(step, pid)) standin_sleep_ms(10);
    world = standin_lock();
    standin_clear_busy(pid);
    if (standin_read_proc(pid, p) != 0) p->state = ST_FAILED;
    return world;
}

/* One operation on one pid: the whole state machine. */
static CUresult standin_op(const char *caller, const char *step, int pid, unsigned int timeout_ms,
                           const standin_pair *pairs, unsigned int npairs, int *out) {
    int code = CUDA_SUCCESS;
    int fault = standin_fault(step, pid, &code);
    if (fault == FAULT_HANG || fault == FAULT_STUCK) {
        /* The call belongs to the world it started in: a caller that gave up on it may have moved
         * on to another world (the next test's) by the time it returns. */
        char started_in[4096] = "";
        const char *dir = standin_dir();
        if (dir) snprintf(started_in, sizeof started_in, "%s", dir);
        if (fault == FAULT_HANG && strcmp(step, "lock") == 0 && timeout_ms) {
            standin_sleep_ms(timeout_ms); /* the work never drains: the lock gives up, still running */
            code = CUDA_ERROR_NOT_READY;
        } else {
            standin_sleep_ms(standin_hang_ms());
            code = CUDA_ERROR_UNKNOWN;
        }
        standin_log_in(started_in[0] ? started_in : NULL, caller, step, pid, code);
        return code;
    }
    int world = standin_lock();
    standin_proc p;
    standin_gpu gpus[MAX_GPUS];
    int ngpus = standin_load_gpus(gpus);
    if (fault == FAULT_ERROR) {
        /* An injected out-of-memory restore behaves like a real one: the process is wedged. */
        if (strcmp(step, "restore") == 0 && code == CUDA_ERROR_OUT_OF_MEMORY && standin_read_proc(pid, &p) == 0 &&
            p.state == ST_CHECKPOINTED) {
            p.wedged = 1;
            standin_write_proc(pid, &p);
        }
        goto done;
    }
    if (world < 0 || (kill(pid, 0) != 0 && errno == ESRCH) || standin_read_proc(pid, &p) != 0) {
        code = CUDA_ERROR_INVALID_VALUE;
        goto done;
    }
    if (!owner_allows(pid)) {
        code = CUDA_ERROR_NOT_PERMITTED;
        goto done;
    }
    char busy_step[32] = "";
    int busy = standin_busy(pid, busy_step, sizeof busy_step);
    if (busy < 0) { /* a checkpoint or restore whose caller died half-way: the driver lost the process */
        standin_clear_busy(pid);
        p.state = ST_FAILED;
        standin_write_proc(pid, &p);
    } else if (busy > 0) {
        if (strcmp(step, "state") == 0) *out = strcmp(busy_step, "restore") == 0 ? ST_RESTORING : ST_CHECKPOINTING;
        else code = CUDA_ERROR_ILLEGAL_STATE;
        goto done;
    }
    if (strcmp(step, "state") == 0) {
        *out = p.state;
    } else if (strcmp(step, "restore-tid") == 0) {
        *out = pid;
    } else if (strcmp(step, "lock") == 0) {
        if (p.state != ST_RUNNING) code = CUDA_ERROR_ILLEGAL_STATE;
        else p.state = ST_LOCKED;
    } else if (strcmp(step, "checkpoint") == 0) {
        if (p.state != ST_LOCKED) code = CUDA_ERROR_ILLEGAL_STATE;
        else if (standin_held(step, pid)) world = standin_hold(world, step, pid, &p);
        if (code == CUDA_SUCCESS) p.state = ST_CHECKPOINTED;
    } else if (strcmp(step, "unlock") == 0) {
        if (p.state != ST_LOCKED) code = CUDA_ERROR_ILLEGAL_STATE;
        else p.state = ST_RUNNING;
    } else if (strcmp(step, "restore") == 0) {
        int gpu = p.gpu;
        if (p.state != ST_CHECKPOINTED) {
            code = CUDA_ERROR_ILLEGAL_STATE;
        } else if (p.wedged) {
            code = CUDA_ERROR_OPERATING_SYSTEM;
        } else if (gpu < 0 || gpu >= ngpus) {
            code = CUDA_ERROR_INVALID_VALUE;
        } else if (!initialized && !gpus[gpu].persistence) {
            code = CUDA_ERROR_NOT_INITIALIZED;
        } else {
            if (npairs) { /* every checkpointed GPU must be named, onto a GPU that exists */
                int found = -1;
                for (unsigned int i = 0; i < npairs && found < 0; i++) {
                    if (memcmp(pairs[i].old_uuid, gpus[gpu].uuid_bytes, 16) == 0) {
                        for (int g = 0; g < ngpus; g++)
                            if (memcmp(pairs[i].new_uuid, gpus[g].uuid_bytes, 16) == 0) found = g;
                        if (found < 0) found = -2;
                    }
                }
                if (found < 0) code = CUDA_ERROR_INVALID_VALUE;
                else gpu = found;
            }
            if (code == CUDA_SUCCESS) {
                unsigned long long used = gpus[gpu].other + standin_gpu_used_by_procs(gpu);
                unsigned long long free_bytes = gpus[gpu].total > used ? gpus[gpu].total - used : 0;
                if (p.bytes > free_bytes) {
                    code = CUDA_ERROR_OUT_OF_MEMORY;
                    p.wedged = 1;
                } else {
                    if (standin_held(step, pid)) world = standin_hold(world, step, pid, &p);
                    p.state = ST_LOCKED;
                    p.gpu = gpu;
                }
            }
        }
    } else {
        code = CUDA_ERROR_INVALID_VALUE;
    }
    if (code == CUDA_SUCCESS || p.wedged) standin_write_proc(pid, &p);
done:
    standin_unlock(world);
    standin_log(caller, step, pid, code);
    return code;
}

static const standin_table table = {sizeof(standin_table), standin_op, standin_init};

CUresult cuGetExportTable(const void **out, const void *table_id) {
    (void)table_id;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    *out = &table;
    return CUDA_SUCCESS;
}

#ifndef STANDIN_NO_CHECKPOINT_API

static int all_zero(const void *data, size_t from, size_t to) {
    const unsigned char *bytes = data;
    for (size_t i = from; i < to; i++)
        if (bytes[i]) return 0;
    return 1;
}

typedef struct {
    unsigned int timeoutMs;
    unsigned int reserved0;
    uint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct {
    standin_pair *gpuPairs;
    unsigned int gpuPairsCount;
    unsigned int padding0;
    uint64_t reserved[6];
} CUcheckpointRestoreArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "lock args are 64 bytes");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "restore args are 64 bytes");
_Static_assert(sizeof(standin_pair) == 32, "a GPU pair is 32 bytes");

CUresult cuCheckpointProcessGetState(int pid, int *state) {
    if (!state) return CUDA_ERROR_INVALID_VALUE;
    return standin_op("driver", "state", pid, 0, NULL, 0, state);
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    if (!tid) return CUDA_ERROR_INVALID_VALUE;
    return standin_op("driver", "restore-tid", pid, 0, NULL, 0, tid);
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    int unused;
    if (args && !all_zero(args, 4, 64)) return CUDA_ERROR_INVALID_VALUE;
    return standin_op("driver", "lock", pid, args ? args->timeoutMs : 0, NULL, 0, &unused);
}

CUresult cuCheckpointProcessCheckpoint(int pid, void *args) {
    int unused;
    if (args && !all_zero(args, 0, 64)) return CUDA_ERROR_INVALID_VALUE;
    return standin_op("driver", "checkpoint", pid, 0, NULL, 0, &unused);
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    int unused;
    if (args) {
        if (standin_version() < 13000) {
            if (!all_zero(args, 0, 64)) return CUDA_ERROR_INVALID_VALUE; /* all reserved before 13.0 */
        } else {
            if (!all_zero(args, 12, 64)) return CUDA_ERROR_INVALID_VALUE;
            if (args->gpuPairsCount && !args->gpuPairs) return CUDA_ERROR_INVALID_VALUE;
            return standin_op("driver", "restore", pid, 0, args->gpuPairs, args->gpuPairsCount, &unused);
        }
    }
    return standin_op("driver", "restore", pid, 0, NULL, 0, &unused);
}

CUresult cuCheckpointProcessUnlock(int pid, void *args) {
    int unused;
    if (args && !all_zero(args, 0, 64)) return CUDA_ERROR_INVALID_VALUE;
    return standin_op("driver", "unlock", pid, 0, NULL, 0, &unused);
}

#endif
