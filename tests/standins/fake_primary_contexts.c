/*
 * Stand-in for the two libcuda calls hibernate's copy seam makes before it puts
 * a thread's current device back: cuDeviceGet and cuDevicePrimaryCtxGetState,
 * with their real signatures and error codes. Which devices have an active
 * primary context is set by the tests (fake_active_contexts, one bit per
 * device); asking never creates one, as with the real driver.
 */
typedef int CUresult;
typedef int CUdevice;

enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_INVALID_DEVICE = 101, fake_device_count = 4 };

/* Read and set by the tests through ctypes. */
long long fake_active_contexts = 0;
long long fake_state_queries = 0;

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (device == 0) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= fake_device_count) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice device, unsigned int *flags, int *active) {
    if (flags == 0 || active == 0) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= fake_device_count) return CUDA_ERROR_INVALID_DEVICE;
    __atomic_add_fetch(&fake_state_queries, 1, __ATOMIC_SEQ_CST);
    *flags = 0;
    *active = (int)((fake_active_contexts >> device) & 1);
    return CUDA_SUCCESS;
}
