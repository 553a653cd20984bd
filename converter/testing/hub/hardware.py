"""The Jobs hardware list (``GET /api/jobs/hardware``), shaped as the Hub answers it.

The CPU rows carry the Hub's published prices (cpu-basic $0.01/h, cpu-upgrade $0.03/h, cpu-xl $1.00/h); the GPU rows
stand in for the real list so that code can tell a GPU flavor from a CPU one and price it. Prices are per minute in
micro-dollars, as the Hub sends them. Real code should read the list at run time.
"""

from __future__ import annotations

from typing import Any


def _entry(
    name: str,
    pretty: str,
    cpu: str,
    ram: str,
    usd_per_hour: float,
    *,
    storage: str | None = None,
    gpu: tuple[str, int, str] | None = None,
) -> dict[str, Any]:
    micro_per_minute = round(usd_per_hour * 1e6 / 60)
    entry: dict[str, Any] = {
        "name": name,
        "prettyName": pretty,
        "cpu": cpu,
        "ram": ram,
        "accelerator": None,
        "unitCostMicroUSD": micro_per_minute,
        "unitCostUSD": micro_per_minute / 1e6,
        "unitLabel": "minute",
    }
    if storage is not None:
        entry["ephemeralStorage"] = storage
    if gpu is not None:
        model, quantity, vram = gpu
        entry["accelerator"] = {
            "type": "gpu",
            "model": model,
            "quantity": str(quantity),
            "vram": vram,
            "manufacturer": "Nvidia",
        }
    return entry


HARDWARE: list[dict[str, Any]] = [
    _entry("cpu-basic", "CPU Basic", "2 vCPU", "16 GB", 0.01, storage="20 GB"),
    _entry("cpu-upgrade", "CPU Upgrade", "8 vCPU", "32 GB", 0.03),
    _entry("cpu-xl", "CPU XL", "16 vCPU", "124 GB", 1.00, storage="1 TB"),
    _entry("t4-small", "Nvidia T4 - small", "4 vCPU", "15 GB", 0.40, gpu=("T4", 1, "16 GB")),
    _entry("l4x1", "1x Nvidia L4", "8 vCPU", "30 GB", 0.80, gpu=("L4", 1, "24 GB")),
    _entry("a10g-large", "Nvidia A10G - large", "12 vCPU", "46 GB", 1.50, gpu=("A10G", 1, "24 GB")),
    _entry("a100-large", "Nvidia A100 - large", "12 vCPU", "142 GB", 2.50, gpu=("A100", 1, "80 GB")),
    _entry("h200", "Nvidia H200", "23 vCPU", "256 GB", 5.00, gpu=("H200", 1, "141 GB")),
]

FLAVORS = frozenset(entry["name"] for entry in HARDWARE)
