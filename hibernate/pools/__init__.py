"""What can be hibernated: pools of memory regions that can be spilled, released and restored.

``base`` holds the contract; ``tensors`` the PyTorch tensors a program names
with ``hibernate.track``; ``vllm`` the allocations of vLLM's CuMemAllocator;
``provided`` the address-preserving pools of ``hibernate.pool()`` and the
choice of their provider (``tms``: torch_memory_saver, or ``vllm``);
``graphs`` which memory a captured CUDA graph may read, so a sleep that would
move it is refused; ``device`` the copies to and from GPU memory all use;
``hostpages`` how host memory torch cannot resize is freed in place.
Importing this package does not import torch.
"""

from hibernate.pools.base import Pool, PoolSummary, SpillableRegion, summarize

__all__ = ["Pool", "PoolSummary", "SpillableRegion", "summarize"]
