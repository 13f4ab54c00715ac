/*
 * Stand-in for libcudart (the CUDA runtime) on a machine without a GPU, built
 * by the tests with the system C compiler. It exports the calls hibernate's
 * CUDA device-memory seam makes, with their real signatures and error codes,
 * over host memory: a "device pointer" is a host address (the tests' host
 * reservations). Counters and a failure switch are exported for the tests.
 *
 * One rule is stricter than CUDA, on purpose: a stream may only be used while
 * its own device is the calling thread's current device (the seam promises to
 * set the device before every operation, from whichever thread it runs on).
 *
 * With the stand-in NVIDIA driver (tests/standins/standin_world.h) a process
 * registered there as locked or checkpointed behaves as the driver documents
 * for cuCheckpointProcessLock: its CUDA calls block until it runs again. Each
 * call that had to wait is counted (fake_calls_while_suspended), so a test can
 * tell that nothing touched the device while the CUDA state was off the GPU.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int cudaError_t;

enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorIllegalAddress = 700,
    cudaErrorHostMemoryAlreadyRegistered = 712,
    cudaErrorHostMemoryNotRegistered = 713,
};

enum { cudaMemcpyDefault = 4, fake_device_count = 4, fake_max_registrations = 1024 };

struct fake_stream {
    int device;
};

static __thread int current_device = 0;
static __thread cudaError_t last_error = cudaSuccess;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    uintptr_t address;
    size_t size;
} registrations[fake_max_registrations];

/* Read (and set) by the tests through ctypes. */
long long fake_streams_created = 0;
long long fake_copies = 0;
long long fake_copied_bytes = 0;
long long fake_registered_bytes = 0;
long long fake_registered_peak = 0;
long long fake_device_synchronizations = 0;
long long fake_fail_copy_at = -1; /* the copy with this index fails with cudaErrorIllegalAddress */
long long fake_calls_while_suspended = 0;

/* This process's state in the stand-in driver's world: 0 running (or not registered). */
static int world_state(void) {
    const char *dir = getenv("HIBERNATE_STANDIN_DIR");
    if (dir == NULL || *dir == '\0') return 0;
    char path[4096];
    snprintf(path, sizeof path, "%s/pid-%d", dir, (int)getpid());
    FILE *f = fopen(path, "r");
    if (f == NULL) return 0;
    int state = 0;
    if (fscanf(f, "%d", &state) != 1) state = 0;
    fclose(f);
    return state;
}

/* A CUDA call of a locked or checkpointed process blocks until the process runs again. */
static void wait_while_suspended(void) {
    if (world_state() == 0) return;
    __atomic_add_fetch(&fake_calls_while_suspended, 1, __ATOMIC_SEQ_CST);
    while (world_state() != 0) {
        struct timespec pause = {0, 5000000L};
        nanosleep(&pause, NULL);
    }
}

static cudaError_t fail(cudaError_t error) {
    last_error = error;
    return error;
}

const char *cudaGetErrorString(cudaError_t error) {
    switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    default: return "unrecognized error code";
    }
}

cudaError_t cudaGetLastError(void) {
    cudaError_t error = last_error;
    last_error = cudaSuccess;
    return error;
}

cudaError_t cudaSetDevice(int device) {
    wait_while_suspended();
    if (device < 0 || device >= fake_device_count) return fail(cudaErrorInvalidDevice);
    current_device = device;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
    wait_while_suspended();
    __atomic_add_fetch(&fake_device_synchronizations, 1, __ATOMIC_SEQ_CST);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(void **stream, unsigned int flags) {
    wait_while_suspended();
    if (stream == NULL || flags > 1) return fail(cudaErrorInvalidValue);
    struct fake_stream *s = malloc(sizeof *s);
    if (s == NULL) return fail(cudaErrorInvalidValue);
    s->device = current_device;
    *stream = s;
    __atomic_add_fetch(&fake_streams_created, 1, __ATOMIC_SEQ_CST);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(void *stream) {
    wait_while_suspended();
    if (stream == NULL) return fail(cudaErrorInvalidResourceHandle);
    return cudaSuccess;
}

static cudaError_t check_stream(void *stream) {
    if (stream == NULL) return fail(cudaErrorInvalidResourceHandle);
    if (((struct fake_stream *)stream)->device != current_device) return fail(cudaErrorInvalidResourceHandle);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, void *stream) {
    wait_while_suspended();
    if (kind != cudaMemcpyDefault || dst == NULL || src == NULL) return fail(cudaErrorInvalidValue);
    if (check_stream(stream) != cudaSuccess) return last_error;
    long long index = __atomic_fetch_add(&fake_copies, 1, __ATOMIC_SEQ_CST);
    if (index == __atomic_load_n(&fake_fail_copy_at, __ATOMIC_SEQ_CST)) return fail(cudaErrorIllegalAddress);
    memcpy(dst, src, count);
    __atomic_add_fetch(&fake_copied_bytes, (long long)count, __ATOMIC_SEQ_CST);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, void *stream) {
    wait_while_suspended();
    if (ptr == NULL) return fail(cudaErrorInvalidValue);
    if (check_stream(stream) != cudaSuccess) return last_error;
    memset(ptr, value, count);
    return cudaSuccess;
}

cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags) {
    wait_while_suspended();
    (void)flags;
    if (ptr == NULL || size == 0) return fail(cudaErrorInvalidValue);
    pthread_mutex_lock(&lock);
    int free_slot = -1;
    for (int i = 0; i < fake_max_registrations; i++) {
        if (registrations[i].address == (uintptr_t)ptr) {
            pthread_mutex_unlock(&lock);
            return fail(cudaErrorHostMemoryAlreadyRegistered);
        }
        if (registrations[i].address == 0 && free_slot < 0) free_slot = i;
    }
    if (free_slot < 0) {
        pthread_mutex_unlock(&lock);
        return fail(cudaErrorInvalidValue);
    }
    registrations[free_slot].address = (uintptr_t)ptr;
    registrations[free_slot].size = size;
    fake_registered_bytes += (long long)size;
    if (fake_registered_bytes > fake_registered_peak) fake_registered_peak = fake_registered_bytes;
    pthread_mutex_unlock(&lock);
    return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *ptr) {
    wait_while_suspended();
    pthread_mutex_lock(&lock);
    for (int i = 0; i < fake_max_registrations; i++) {
        if (registrations[i].address == (uintptr_t)ptr) {
            fake_registered_bytes -= (long long)registrations[i].size;
            registrations[i].address = 0;
            registrations[i].size = 0;
            pthread_mutex_unlock(&lock);
            return cudaSuccess;
        }
    }
    pthread_mutex_unlock(&lock);
    return fail(cudaErrorHostMemoryNotRegistered);
}
