"""Distributed backends for the training loop (``runtime.backend: ray``)."""
from specopd.distributed.ray_backend import ClusterTooSmallError, RayGroup, WorkerLostError, last_checkpoint

__all__ = ["RayGroup", "WorkerLostError", "ClusterTooSmallError", "last_checkpoint"]
