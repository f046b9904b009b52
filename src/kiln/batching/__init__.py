"""The batching core: the queue that forms batches (preferred sizes, queue delay, priorities, timeouts), the
dynamic batcher's workers, and the runners that execute on the event loop (inline) or launch onto a device.

The server's schedulers (kiln.server.scheduler) and the direct engine (kiln.load) both build on it.
"""

from kiln.batching.dynamic import DynamicBatcher
from kiln.batching.model import BatchLog, BatchModel, ExecutionTimes, Recorder
from kiln.batching.policy import BatchingPolicy, QueuePolicy

__all__ = ["BatchLog", "BatchModel", "BatchingPolicy", "DynamicBatcher", "ExecutionTimes", "QueuePolicy",
           "Recorder"]
