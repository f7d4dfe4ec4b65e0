"""Distributed backends for the training loop (``runtime.backend: ray``)."""
from specopd.distributed.ray_backend import ClusterTooSmallError, RayGroup, WorkerLostError

__all__ = ["RayGroup", "WorkerLostError", "ClusterTooSmallError"]
