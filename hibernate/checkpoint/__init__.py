"""Taking what the pools leave (CUDA context, communicators, kernels, graphs) off the GPU.

``base`` defines the checkpointer interface and CUDA states; ``detect`` finds
which processes hold a CUDA context. Driven from outside the target: a process
cannot lock or checkpoint itself.
"""
