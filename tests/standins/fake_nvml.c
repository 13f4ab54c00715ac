/*
 * STAND-IN for tests only: a fake libnvidia-ml.so.1 over the same world as the fake libcuda.
 *
 * GPUs come from $HIBERNATE_STANDIN_DIR/gpus; a GPU's used memory is its
 * OTHER_USED_BYTES plus the bytes of every registered process whose CUDA
 * state is on it (running or locked: a checkpointed process holds nothing),
 * which is also what the fake restore checks against. Only the entry points
 * hibernate calls exist, with NVML's signatures and return codes
 * (NVML_ERROR_NOT_SUPPORTED for the MIG mode of a GPU without MIG,
 * NVML_ERROR_INSUFFICIENT_SIZE for a short process list).
 */
#include <dirent.h>
#include <stdint.h>

#include "standin_world.h"

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
};

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

static standin_gpu gpus[MAX_GPUS];
static int ngpus = -1;

static int index_of(void *handle) {
    long index = (long)(intptr_t)handle - 1;
    return (ngpus > 0 && index >= 0 && index < ngpus) ? (int)index : -1;
}

nvmlReturn_t nvmlInit_v2(void) {
    ngpus = standin_load_gpus(gpus);
    return ngpus > 0 ? NVML_SUCCESS : NVML_ERROR_DRIVER_NOT_LOADED;
}

nvmlReturn_t nvmlShutdown(void) {
    ngpus = -1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *out, unsigned int len) {
    const char *release = getenv("HIBERNATE_STANDIN_DRIVER_RELEASE");
    if (ngpus < 0) return NVML_ERROR_UNINITIALIZED;
    snprintf(out, len, "%s", release && *release ? release : "580.95.05");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (ngpus < 0) return NVML_ERROR_UNINITIALIZED;
    *count = (unsigned int)ngpus;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **handle) {
    if (ngpus < 0) return NVML_ERROR_UNINITIALIZED;
    if ((int)index >= ngpus) return NVML_ERROR_INVALID_ARGUMENT;
    *handle = (void *)(intptr_t)(index + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(void *handle, char *out, unsigned int len) {
    int i = index_of(handle);
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(out, len, "%s", gpus[i].uuid);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(void *handle, char *out, unsigned int len) {
    int i = index_of(handle);
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(out, len, "%s", gpus[i].name);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(void *handle, nvmlMemory_t *memory) {
    int i = index_of(handle);
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT;
    int world = standin_lock();
    unsigned long long used = gpus[i].other + standin_gpu_used_by_procs(i);
    standin_unlock(world);
    memory->total = gpus[i].total;
    memory->used = used < gpus[i].total ? used : gpus[i].total;
    memory->free = gpus[i].total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(void *handle, int *mode) {
    int i = index_of(handle);
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = gpus[i].persistence ? 1 : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(void *handle, unsigned int *current, unsigned int *pending) {
    int i = index_of(handle);
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (gpus[i].mig < 0) return NVML_ERROR_NOT_SUPPORTED;
    *current = *pending = (unsigned int)gpus[i].mig;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(void *handle, unsigned int *minor) {
    int i = index_of(handle);
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = (unsigned int)i;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *handle, unsigned int *count, nvmlProcessInfo_t *infos) {
    int gpu = index_of(handle);
    if (gpu < 0 || !count) return NVML_ERROR_INVALID_ARGUMENT;
    const char *dir = standin_dir();
    unsigned int n = 0, room = *count;
    int world = standin_lock();
    DIR *d = dir ? opendir(dir) : NULL;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        int pid;
        standin_proc p;
        if (sscanf(e->d_name, "pid-%d", &pid) != 1 || strchr(e->d_name, '.')) continue;
        if (standin_read_proc(pid, &p) != 0 || p.gpu != gpu) continue;
        if (p.state != ST_RUNNING && p.state != ST_LOCKED) continue;
        if (n < room && infos) {
            infos[n].pid = (unsigned int)pid;
            infos[n].usedGpuMemory = p.bytes;
            infos[n].gpuInstanceId = infos[n].computeInstanceId = 0xFFFFFFFFu;
        }
        n++;
    }
    if (d) closedir(d);
    standin_unlock(world);
    *count = n;
    return n > room ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}
