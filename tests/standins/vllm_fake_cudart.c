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
 * Asynchronous work is asynchronous, as the CUDA stream contract allows at its
 * slowest: cudaMemcpyAsync and cudaMemsetAsync only queue on their stream, in
 * order, and the queue runs when that stream is synchronized
 * (cudaStreamSynchronize) or its device is (cudaDeviceSynchronize, which waits
 * for every stream of the current device). Nothing orders two non-blocking
 * streams, so a copy on one does not see a write still queued on another: a
 * program's side-stream write is "in flight" until someone synchronizes. The
 * host side of a queued copy is read when it runs, as on a GPU. A global
 * sequence number stamps each queued operation and each device
 * synchronization, so a test can tell which came last.
 *
 * Events follow the runtime's contract: cudaEventRecord queues a marker on its
 * stream, and the event completes when everything queued on that stream before
 * the marker has run (re-recording it moves it to the newest marker; an event
 * never recorded is complete). Here the queue runs only when someone waits, so
 * cudaEventQuery answers cudaErrorNotReady (600, not an error) until a wait ran
 * past the marker, and cudaEventSynchronize runs the event's stream up to its
 * marker and no further: work queued after the record has not run when it
 * returns, which a test can see. cudaEventDestroy of an event still pending
 * returns at once and frees it once its marker ran, as the runtime does. Every
 * call that waits (stream, event or device synchronization) is counted in
 * fake_synchronize_count.
 *
 * A copy may also fail when it runs instead of when it is queued
 * (fake_fail_run_at): as on a GPU, the call that waits for it returns the
 * error. Unlike a real context the error is not sticky, so a test that
 * provokes one leaves the library usable for the next.
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
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorHostMemoryAlreadyRegistered = 712,
    cudaErrorHostMemoryNotRegistered = 713,
};

enum { cudaMemcpyDefault = 4, fake_device_count = 4, fake_max_registrations = 1024 };
/* cudaEventDefault, BlockingSync, DisableTiming, Interprocess: the flags the runtime accepts. */
enum { fake_event_flags = 0x1 | 0x2 | 0x4 };
enum { op_copy = -1, op_marker = -2 };

struct fake_event;

/* One queued memcpy (value op_copy), memset (value = the byte) or event marker (op_marker). */
struct fake_op {
    void *dst;
    const void *src;
    size_t count;
    int value;
    int fails;                /* a copy that fails when it runs (fake_fail_run_at) */
    struct fake_event *event; /* a marker's event, and which of its records this is */
    long long record;
    struct fake_op *next;
};

struct fake_event {
    int device;
    struct fake_stream *stream; /* where its newest record's marker is queued */
    long long recorded;         /* records so far: the newest is the one that counts */
    long long reached;          /* the newest record whose marker ran */
    int markers;                /* its markers still queued */
    int destroyed;              /* freed once its last marker ran */
};

struct fake_stream {
    int device;
    struct fake_op *head, *tail;
    struct fake_stream *next_stream; /* every stream ever created, for cudaDeviceSynchronize */
};

static struct fake_stream *all_streams = NULL;

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
long long fake_host_registrations = 0; /* successful cudaHostRegister calls */
long long fake_device_synchronizations = 0;
long long fake_fail_copy_at = -1; /* the copy with this index fails with cudaErrorIllegalAddress */
long long fake_calls_while_suspended = 0;
long long fake_sequence = 0;             /* stamps queued operations and device synchronizations */
long long fake_last_queued = 0;          /* the stamp of the newest queued copy or memset */
long long fake_last_device_synchronize = 0; /* the stamp of the newest cudaDeviceSynchronize */
long long fake_synchronize_count = 0;  /* calls that waited: stream, event and device synchronizations */
long long fake_event_synchronizations = 0;
long long fake_events_created = 0;
long long fake_events_destroyed = 0;
long long fake_fail_run_at = -1; /* the copy with this index fails when it runs, reported by the wait */

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
    case cudaErrorNotReady: return "device not ready";
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

cudaError_t cudaGetDevice(int *device) {
    wait_while_suspended();
    if (device == NULL) return fail(cudaErrorInvalidValue);
    *device = current_device;
    return cudaSuccess;
}

/* Run one queued operation; the caller holds the lock. A copy that fails when it runs copies nothing. */
static cudaError_t run(struct fake_op *op) {
    if (op->value == op_copy) {
        if (op->fails) return cudaErrorIllegalAddress;
        memcpy(op->dst, op->src, op->count);
    } else if (op->value == op_marker) {
        struct fake_event *e = op->event;
        if (op->record > e->reached) e->reached = op->record;
        if (--e->markers == 0 && e->destroyed) free(e);
    } else {
        memset(op->dst, op->value, op->count);
    }
    return cudaSuccess;
}

/* Run a stream's queued work, oldest first, up to and including ``last`` (NULL: all of it); the first
 * failure is returned once the work is run. The caller holds the lock. */
static cudaError_t drain_until(struct fake_stream *s, const struct fake_op *last) {
    cudaError_t error = cudaSuccess;
    struct fake_op *op = s->head;
    while (op != NULL) {
        cudaError_t result = run(op);
        if (error == cudaSuccess) error = result;
        struct fake_op *done = op;
        op = op->next;
        free(done);
        if (done == last) break;
    }
    s->head = op;
    if (op == NULL) s->tail = NULL;
    return error;
}

static cudaError_t drain(struct fake_stream *s) { return drain_until(s, NULL); }

/* Queue ``op`` (filled in, next unset) on ``s``; the caller holds the lock. */
static void append(struct fake_stream *s, struct fake_op *op) {
    op->next = NULL;
    if (s->tail != NULL)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
}

static cudaError_t enqueue(struct fake_stream *s, void *dst, const void *src, size_t count, int value, int fails) {
    struct fake_op *op = malloc(sizeof *op);
    if (op == NULL) return fail(cudaErrorInvalidValue);
    *op = (struct fake_op){dst, src, count, value, fails, NULL, 0, NULL};
    pthread_mutex_lock(&lock);
    append(s, op);
    fake_last_queued = ++fake_sequence;
    pthread_mutex_unlock(&lock);
    return cudaSuccess;
}

static cudaError_t waited(cudaError_t error) {
    __atomic_add_fetch(&fake_synchronize_count, 1, __ATOMIC_SEQ_CST);
    return error == cudaSuccess ? error : fail(error);
}

cudaError_t cudaSetDevice(int device) {
    wait_while_suspended();
    if (device < 0 || device >= fake_device_count) return fail(cudaErrorInvalidDevice);
    current_device = device;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
    wait_while_suspended();
    cudaError_t error = cudaSuccess;
    pthread_mutex_lock(&lock);
    for (struct fake_stream *s = all_streams; s != NULL; s = s->next_stream) {
        if (s->device != current_device) continue;
        cudaError_t result = drain(s);
        if (error == cudaSuccess) error = result;
    }
    fake_last_device_synchronize = ++fake_sequence;
    pthread_mutex_unlock(&lock);
    __atomic_add_fetch(&fake_device_synchronizations, 1, __ATOMIC_SEQ_CST);
    return waited(error);
}

cudaError_t cudaStreamCreateWithFlags(void **stream, unsigned int flags) {
    wait_while_suspended();
    if (stream == NULL || flags > 1) return fail(cudaErrorInvalidValue);
    struct fake_stream *s = malloc(sizeof *s);
    if (s == NULL) return fail(cudaErrorInvalidValue);
    s->device = current_device;
    s->head = s->tail = NULL;
    pthread_mutex_lock(&lock);
    s->next_stream = all_streams;
    all_streams = s;
    pthread_mutex_unlock(&lock);
    *stream = s;
    __atomic_add_fetch(&fake_streams_created, 1, __ATOMIC_SEQ_CST);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(void *stream) {
    wait_while_suspended();
    if (stream == NULL) return fail(cudaErrorInvalidResourceHandle);
    pthread_mutex_lock(&lock);
    cudaError_t error = drain(stream);
    pthread_mutex_unlock(&lock);
    return waited(error);
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
    int fails = index == __atomic_load_n(&fake_fail_run_at, __ATOMIC_SEQ_CST);
    if (!fails) __atomic_add_fetch(&fake_copied_bytes, (long long)count, __ATOMIC_SEQ_CST);
    return enqueue(stream, dst, src, count, op_copy, fails);
}

cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, void *stream) {
    wait_while_suspended();
    if (ptr == NULL) return fail(cudaErrorInvalidValue);
    if (check_stream(stream) != cudaSuccess) return last_error;
    return enqueue(stream, ptr, NULL, count, value & 0xff, 0);
}

cudaError_t cudaEventCreateWithFlags(void **event, unsigned int flags) {
    wait_while_suspended();
    if (event == NULL || (flags & ~(unsigned int)fake_event_flags) != 0) return fail(cudaErrorInvalidValue);
    struct fake_event *e = calloc(1, sizeof *e);
    if (e == NULL) return fail(cudaErrorInvalidValue);
    e->device = current_device;
    *event = e;
    __atomic_add_fetch(&fake_events_created, 1, __ATOMIC_SEQ_CST);
    return cudaSuccess;
}

/* The stream and the event must be of one device, the current one (see the stricter rule above). */
cudaError_t cudaEventRecord(void *event, void *stream) {
    wait_while_suspended();
    if (check_stream(stream) != cudaSuccess) return last_error;
    struct fake_event *e = event;
    if (e == NULL || e->destroyed || e->device != current_device) return fail(cudaErrorInvalidResourceHandle);
    struct fake_op *op = malloc(sizeof *op);
    if (op == NULL) return fail(cudaErrorInvalidValue);
    pthread_mutex_lock(&lock);
    *op = (struct fake_op){NULL, NULL, 0, op_marker, 0, e, ++e->recorded, NULL};
    e->stream = stream;
    e->markers++;
    append(stream, op);
    pthread_mutex_unlock(&lock);
    return cudaSuccess;
}

static int complete(const struct fake_event *e) { return e->reached == e->recorded; }

cudaError_t cudaEventQuery(void *event) {
    wait_while_suspended();
    struct fake_event *e = event;
    if (e == NULL || e->destroyed) return fail(cudaErrorInvalidResourceHandle);
    pthread_mutex_lock(&lock);
    int done = complete(e);
    pthread_mutex_unlock(&lock);
    return done ? cudaSuccess : cudaErrorNotReady; /* not ready is an answer, not an error */
}

cudaError_t cudaEventSynchronize(void *event) {
    wait_while_suspended();
    struct fake_event *e = event;
    if (e == NULL || e->destroyed) return fail(cudaErrorInvalidResourceHandle);
    cudaError_t error = cudaSuccess;
    pthread_mutex_lock(&lock);
    if (!complete(e)) {
        const struct fake_op *marker = e->stream->head;
        while (marker != NULL && !(marker->event == e && marker->record == e->recorded)) marker = marker->next;
        error = drain_until(e->stream, marker);
    }
    pthread_mutex_unlock(&lock);
    __atomic_add_fetch(&fake_event_synchronizations, 1, __ATOMIC_SEQ_CST);
    return waited(error);
}

cudaError_t cudaEventDestroy(void *event) {
    wait_while_suspended();
    struct fake_event *e = event;
    if (e == NULL || e->destroyed) return fail(cudaErrorInvalidResourceHandle);
    pthread_mutex_lock(&lock);
    e->destroyed = 1;
    if (e->markers == 0) free(e);
    pthread_mutex_unlock(&lock);
    __atomic_add_fetch(&fake_events_destroyed, 1, __ATOMIC_SEQ_CST);
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
    fake_host_registrations++;
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
