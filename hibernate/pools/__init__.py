"""What can be hibernated: pools of memory regions that can be spilled, released and restored.

``base`` holds the contract; ``tensors`` the PyTorch tensors a program names
with ``hibernate.track``; ``vllm`` the allocations of vLLM's CuMemAllocator;
``device`` the copies to and from GPU memory both use; ``hostpages`` how host
memory torch cannot resize is freed in place.
Importing this package does not import torch.
"""

from hibernate.pools.base import Pool, PoolSummary, SpillableRegion, summarize

__all__ = ["Pool", "PoolSummary", "SpillableRegion", "summarize"]
