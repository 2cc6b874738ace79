"""Communication: pure schedules, transports and the engine that runs them."""

from hopq.comm.collectives import all_reduce, reduce_scatter
from hopq.comm.engine import RunStats
from hopq.comm.topology import TOPOLOGIES, Schedule, get_schedule

__all__ = ["TOPOLOGIES", "RunStats", "Schedule", "all_reduce", "get_schedule", "reduce_scatter"]
