"""Cost and capacity: GPU list prices, goodput at the latency targets, dollars per million output
tokens, and the replicas a request rate needs per GPU type and layout.

* :mod:`._prices`: the price table (``data/gpu_prices.yaml`` or the user's own), validated.
* :mod:`._goodput`: goodput (only requests that met the targets count) and the cost arithmetic, pure.
* :mod:`._capacity`: ``servetune capacity``'s table, from the simulator (calibrated or not, said per row).
"""

from servetune.cost._capacity import (BISECT_STEPS, TP_SIZES, CapacityRow, ReplicaCapacity, calibration_evidence,
                                      capacity_table, layouts, meets_limits, replica_capacity)
from servetune.cost._goodput import LATENCY_TARGETS, Goodput, cost_per_mtok, goodput, request_meets, slo_figures
from servetune.cost._prices import SHIPPED_PRICES, GpuPrice, PriceTable, load_prices

__all__ = ["GpuPrice", "PriceTable", "load_prices", "SHIPPED_PRICES", "Goodput", "goodput", "cost_per_mtok",
           "request_meets", "slo_figures", "LATENCY_TARGETS", "CapacityRow", "ReplicaCapacity", "capacity_table",
           "replica_capacity", "layouts", "calibration_evidence", "meets_limits", "BISECT_STEPS", "TP_SIZES"]
