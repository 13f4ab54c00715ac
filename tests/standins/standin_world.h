/*
 * STAND-IN for tests only: the shared state of a pretend NVIDIA driver.
 *
 * The fake libcuda.so.1, the fake cuda-checkpoint (through that library) and
 * the fake libnvidia-ml.so.1 all read and write one world kept in files under
 * $HIBERNATE_STANDIN_DIR, under an flock, so a pid's CUDA state is the same
 * whichever of them is asked:
 *
 *   gpus          one GPU per line: UUID TOTAL_BYTES OTHER_USED_BYTES PERSISTENCE MIG NAME
 *   pid-<PID>     a registered CUDA process: STATE GPU_INDEX BYTES WEDGED
 *                 (STATE as CUprocessState: 0 running 1 locked 2 checkpointed 3 failed)
 *   calls.log     every call: CALLER STEP PID RESULT_NAME
 *   hold-<STEP>-<PID>  while it exists, a checkpoint or restore of PID (STEP) that has begun
 *                 does not end: the test decides how long the call takes, by a state it sets
 *   pid-<PID>.busy     a checkpoint or restore of PID in progress: STEP CALLER_PID CALLER_START_TIME.
 *                 While its caller lives, GetState answers checkpointing (4) or restoring (5) and
 *                 every other call fails with CUDA_ERROR_ILLEGAL_STATE; once its caller is gone
 *                 (killed, or exited, in the middle of the call) the process is in the failed
 *                 state (3) for good: a checkpoint or restore cut half-way loses the process.
 *
 * Faults: $HIBERNATE_STANDIN_FAULTS = "step[@pid]=ACTION,..." where step is
 * init, state, lock, checkpoint, restore, unlock or restore-tid and ACTION a
 * CUresult name or number, or "hang" (sleep $HIBERNATE_STANDIN_HANG_S, default
 * 3600, then fail with CUDA_ERROR_UNKNOWN; a lock with a timeout instead waits
 * out the timeout and fails with CUDA_ERROR_NOT_READY, leaving the process
 * running, as the driver documents), or "stuck" (a hang that ignores a lock's
 * timeout too: a driver call that outlives every bound hibernate sets).
 *
 * Written from the public contract (CUDA driver API docs, cuda.h values,
 * NVIDIA/cuda-checkpoint README and issues); no NVIDIA code.
 */
#ifndef STANDIN_WORLD_H
#define STANDIN_WORLD_H

#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "standin_uuid.h"

typedef int CUresult;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_TIMEOUT = 909,
    CUDA_ERROR_UNKNOWN = 999,
};

enum { ST_RUNNING = 0, ST_LOCKED = 1, ST_CHECKPOINTED = 2, ST_FAILED = 3, ST_CHECKPOINTING = 4, ST_RESTORING = 5 };

static const struct {
    int code;
    const char *name;
    const char *text;
} standin_errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {909, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

#define N_ERRORS (sizeof(standin_errors) / sizeof(standin_errors[0]))

static const char *standin_error_name(int code) {
    for (size_t i = 0; i < N_ERRORS; i++)
        if (standin_errors[i].code == code) return standin_errors[i].name;
    return NULL;
}

static const char *standin_error_text(int code) {
    for (size_t i = 0; i < N_ERRORS; i++)
        if (standin_errors[i].code == code) return standin_errors[i].text;
    return NULL;
}

static int standin_error_code(const char *name) {
    if (name[0] >= '0' && name[0] <= '9') return atoi(name);
    for (size_t i = 0; i < N_ERRORS; i++)
        if (strcmp(standin_errors[i].name, name) == 0) return standin_errors[i].code;
    return CUDA_ERROR_UNKNOWN;
}

#define MAX_GPUS 16

typedef struct {
    char uuid[96];
    unsigned char uuid_bytes[16];
    unsigned long long total, other;
    int persistence, mig;
    char name[64];
} standin_gpu;

typedef struct {
    int state, gpu;
    unsigned long long bytes;
    int wedged;
} standin_proc;

static const char *standin_dir(void) {
    const char *dir = getenv("HIBERNATE_STANDIN_DIR");
    return (dir && *dir) ? dir : NULL;
}

static int standin_lock(void) {
    char path[4096];
    const char *dir = standin_dir();
    if (!dir) return -1;
    snprintf(path, sizeof path, "%s/lock", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0) flock(fd, LOCK_EX);
    return fd;
}

static void standin_unlock(int fd) {
    if (fd >= 0) {
        flock(fd, LOCK_UN);
        close(fd);
    }
}

static int standin_load_gpus(standin_gpu *gpus) {
    char path[4096];
    const char *dir = standin_dir();
    if (!dir) return 0;
    snprintf(path, sizeof path, "%s/gpus", dir);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int n = 0;
    while (n < MAX_GPUS) {
        standin_gpu *g = &gpus[n];
        memset(g, 0, sizeof *g);
        if (fscanf(f, "%95s %llu %llu %d %d %63s", g->uuid, &g->total, &g->other, &g->persistence, &g->mig,
                   g->name) != 6)
            break;
        if (standin_parse_uuid(g->uuid, strlen(g->uuid), g->uuid_bytes) != 0) break;
        n++;
    }
    fclose(f);
    return n;
}

static int standin_read_proc(int pid, standin_proc *p) {
    char path[4096];
    const char *dir = standin_dir();
    if (!dir) return -1;
    snprintf(path, sizeof path, "%s/pid-%d", dir, pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int ok = fscanf(f, "%d %d %llu %d", &p->state, &p->gpu, &p->bytes, &p->wedged) == 4;
    fclose(f);
    return ok ? 0 : -1;
}

static void standin_write_proc(int pid, const standin_proc *p) {
    char path[4096], tmp[4200];
    const char *dir = standin_dir();
    if (!dir) return;
    snprintf(path, sizeof path, "%s/pid-%d", dir, pid);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "%d %d %llu %d\n", p->state, p->gpu, p->bytes, p->wedged);
    fclose(f);
    rename(tmp, path);
}

/* Bytes held on GPU `gpu` by registered processes whose memory is on the GPU (running or locked). */
static unsigned long long standin_gpu_used_by_procs(int gpu) {
    const char *dir = standin_dir();
    unsigned long long used = 0;
    if (!dir) return 0;
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int pid;
        standin_proc p;
        if (sscanf(e->d_name, "pid-%d", &pid) != 1 || strchr(e->d_name, '.')) continue;
        if (standin_read_proc(pid, &p) != 0) continue;
        if (p.gpu == gpu && (p.state == ST_RUNNING || p.state == ST_LOCKED)) used += p.bytes;
    }
    closedir(d);
    return used;
}

/* Append one call to the log of the world in `dir` (none if NULL). */
static void standin_log_in(const char *dir, const char *caller, const char *step, int pid, int result) {
    char path[4096];
    if (!dir) return;
    snprintf(path, sizeof path, "%s/calls.log", dir);
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return;
    const char *name = standin_error_name(result);
    char line[256];
    int n = name ? snprintf(line, sizeof line, "%s %s %d %s\n", caller, step, pid, name)
                 : snprintf(line, sizeof line, "%s %s %d %d\n", caller, step, pid, result);
    if (write(fd, line, (size_t)n) < 0) { /* nothing to do */
    }
    close(fd);
}

static void standin_log(const char *caller, const char *step, int pid, int result) {
    standin_log_in(standin_dir(), caller, step, pid, result);
}

/* Start time of `pid` (field 22 of /proc/PID/stat), or 0 if it is gone or a zombie (dead either way). */
static unsigned long long standin_start_time(int pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *close_paren = strrchr(buf, ')');
    if (!close_paren || close_paren[1] != ' ') return 0;
    char state = close_paren[2];
    if (state == 'Z' || state == 'X') return 0;
    char *field = close_paren + 2; /* field 3 */
    for (int i = 3; i < 22 && field; i++) {
        field = strchr(field, ' ');
        if (field) field++;
    }
    return field ? strtoull(field, NULL, 10) : 0;
}

static void standin_path(char *out, size_t size, const char *name, int pid, const char *suffix) {
    snprintf(out, size, "%s/%s%d%s", standin_dir(), name, pid, suffix);
}

/* A checkpoint or restore of `pid` in progress: 0 none; 1 its caller lives (*step set); -1 its caller
 * is gone: the call was cut half-way. */
static int standin_busy(int pid, char *step, size_t size) {
    char path[4096], found[32];
    unsigned long long caller_start = 0;
    int caller = 0;
    if (!standin_dir()) return 0;
    standin_path(path, sizeof path, "pid-", pid, ".busy");
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int ok = fscanf(f, "%31s %d %llu", found, &caller, &caller_start) == 3;
    fclose(f);
    if (!ok) return 0;
    snprintf(step, size, "%s", found);
    return standin_start_time(caller) == caller_start ? 1 : -1;
}

/* Written whole, then renamed into place: a reader (this library in another process, or the test's
 * World.state) never sees it half-written. */
static void standin_mark_busy(int pid, const char *step) {
    char path[4096], tmp[4200];
    standin_path(path, sizeof path, "pid-", pid, ".busy");
    snprintf(tmp, sizeof tmp, "%s.tmp-%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "%s %d %llu\n", step, (int)getpid(), standin_start_time((int)getpid()));
    fclose(f);
    rename(tmp, path);
}

static void standin_clear_busy(int pid) {
    char path[4096];
    standin_path(path, sizeof path, "pid-", pid, ".busy");
    unlink(path);
}

/* Does the test hold `step` of `pid` from ending (hold-<STEP>-<PID> exists)? */
static int standin_held(const char *step, int pid) {
    char path[4096];
    struct stat st;
    if (!standin_dir()) return 0;
    snprintf(path, sizeof path, "%s/hold-%s-%d", standin_dir(), step, pid);
    return stat(path, &st) == 0;
}

enum { FAULT_NONE = 0, FAULT_ERROR = 1, FAULT_HANG = 2, FAULT_STUCK = 3 };

/* Is a fault injected for `step` on `pid`? Sets *code for FAULT_ERROR. */
static int standin_fault(const char *step, int pid, int *code) {
    const char *spec = getenv("HIBERNATE_STANDIN_FAULTS");
    if (!spec || !*spec) return FAULT_NONE;
    char buf[2048];
    snprintf(buf, sizeof buf, "%s", spec);
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq) continue;
        *eq = '\0';
        char *action = eq + 1;
        char *at = strchr(item, '@');
        if (at) {
            *at = '\0';
            if (atoi(at + 1) != pid) continue;
        }
        if (strcmp(item, step) != 0) continue;
        if (strcmp(action, "hang") == 0) return FAULT_HANG;
        if (strcmp(action, "stuck") == 0) return FAULT_STUCK;
        *code = standin_error_code(action);
        return FAULT_ERROR;
    }
    return FAULT_NONE;
}

static void standin_sleep_ms(unsigned long long ms) {
    struct timespec t = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {
    }
}

static unsigned long long standin_hang_ms(void) {
    const char *s = getenv("HIBERNATE_STANDIN_HANG_S");
    return (unsigned long long)((s && *s ? atof(s) : 3600.0) * 1000.0);
}

#endif
