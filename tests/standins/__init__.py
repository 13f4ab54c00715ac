"""STAND-INS for tests: a fake NVIDIA driver (libcuda, cuda-checkpoint, NVML) built from C at test time."""
