"""Memory bandwidth: the buffer the check copies (`myria.device.measure_copy_bandwidth`)."""

from __future__ import annotations

MEMBW_BYTES = {"cpu": 128 * 2**20, "cuda": 1 << 30}


