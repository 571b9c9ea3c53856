"""Calibration files for GPUs expertsim has not measured, built from public figures (sm_120: RTX 5090, RTX PRO
6000 Blackwell) and the structure of this project's H200 measurement.

Every number says where it comes from (reference/hardware-and-gguf.md, "hw §N"):
- copy-engine bandwidths: public nvbandwidth / p2pBandwidthLatencyTest results [M] (D2D read+write halved,
  hw §1.1) or, where none exists, the same die and link [E];
- fixed costs (per copy, per step, per launch, sync): the H200 figures scaled by k = 2.07 / 4.63, the RTX
  5090's same-GPU small-copy latency (p2pBandwidthLatencyTest, GPU timeline, hw §1.7) over the H200 VM's
  GPU time per tiny copy (hw Appendix A) [E from M/H]: bare metal is nearer 2-3 us than the VM's 4-6 us;
- gather-kernel bandwidths: the card's copy-engine figure times the ratio the gather kernel reached against
  it on the H200 (0.92 for D2D, 0.92 H2D mapped, 0.95 D2H mapped) [E from M/H].

`build(h200_record)` gives both records; tests/test_calibrate.py checks that the committed files match it.
Run `python -m sim.calibrate.published` to rewrite them after the H200 file changes. Once someone runs
`expertsim calibrate` on such a card, its measured file replaces the published one.
"""

from __future__ import annotations

from pathlib import Path

from sim.calibrate import fileformat
from sim.units import GIB, MIB

CAL_DIR = Path(__file__).resolve().parents[2] / "scenarios" / "hardware" / "calibration"
LATENCY_SCALE = 2.07 / 4.63  # RTX 5090 same-GPU small copy (GPU timeline) / H200 VM tiny-copy GPU time
K_SOURCE = ("[E from M/H] this project's H200 figure x 2.07/4.63 (RTX 5090 same-GPU small-copy latency, "
            "aikitoria/open-gpu-kernel-modules#9, hw §1.7, over the H200 VM's 4.63 us per tiny copy, hw Appendix A)")

CARDS = {
    "rtx-5090": {
        "gpu": {"name": "NVIDIA GeForce RTX 5090", "compute_capability": "12.0", "multiprocessors": 170,
                "memory_total_bytes": 32 * GIB, "l2_bytes": 96 * MIB},
        "extra_note": "Linux figures: on Windows (WDDM) RAM<->GPU transfers on this card are reported 2-3x "
                      "slower (hw §1.2); the rtx-5090-48gb-windows profile keeps its own halved PCIe rates.",
        "ce_gbps": {
            "d2d": (790.0, "[M] p2pBandwidthLatencyTest diagonal 1,519-1,553 GB/s (aikitoria/open-gpu-kernel-modules#9) "
                           "and 1,636-1,646 GB/s (ikawrakow/ik_llama.cpp#1022) read+write, halved (hw §1.1): "
                           "760-820 GB/s bytes copied, mid value"),
            "h2d": (56.3, "[M] nvbandwidth host_to_device_memcpy_ce 56.30-56.41 GB/s, 8x RTX 5090 "
                          "(tinygrad/open-gpu-kernel-modules#29, hw §1.2)"),
            "d2h": (57.3, "[M] nvbandwidth device_to_host_memcpy_ce 57.29-57.35 GB/s "
                          "(tinygrad/open-gpu-kernel-modules#29, hw §1.2)"),
        },
    },
    "rtx-pro-6000": {
        "gpu": {"name": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "compute_capability": "12.0",
                "multiprocessors": 188, "memory_total_bytes": 96 * GIB, "l2_bytes": 128 * MIB},
        "extra_note": "",
        "ce_gbps": {
            "d2d": (800.0, "[M] p2pBandwidthLatencyTest diagonal 1,600-1,604 GB/s read+write, halved (hw §1.1) "
                           "(ikawrakow/ik_llama.cpp#1022, device 0 = RTX PRO 6000 Blackwell WE, hw §1.3)"),
            "h2d": (55.0, "[E] same die and PCIe 5.0 x16 link as the RTX 5090 (56.3 GB/s measured); UCX uses "
                          "50 GB/s as its conservative figure for this card (openucx/ucx#11865, hw §1.3)"),
            "d2h": (55.0, "[E] same die and link as the RTX 5090 (57.3 GB/s measured), hw §1.3"),
        },
    },
}


def _ratio(h200: dict, path: str) -> float:
    copies = h200["references"]["copies"][path]
    return copies["gather_gbps"] / copies["copy_gbps"]


def build(h200: dict) -> dict:
    """name -> calibration record of every card in CARDS."""
    base = fileformat.plain_parameters(h200)
    out = {}
    for name, card in CARDS.items():
        paths: dict = {}
        for path, ways in base["paths"].items():
            gbps, gsource = card["ce_gbps"][path]
            paths[path] = {}
            for way, terms in ways.items():
                leaves = {}
                for term, value in terms.items():
                    if term == "gbps" and way == "gather":
                        r = _ratio(h200, path)
                        leaves[term] = fileformat._leaf(
                            gbps * r, "GB/s", f"[E from M/H] {gbps:g} GB/s x {r:.3f}, the gather kernel's share of "
                                              f"the copy engine's {path} rate on this project's H200")
                    elif term == "gbps":
                        leaves[term] = fileformat._leaf(gbps, "GB/s", gsource)
                    elif term == "per_descriptor_us":
                        leaves[term] = fileformat._leaf(value, "us", "[E from H] this project's H200 figure "
                                                                     "(per-descriptor work inside the kernel)")
                    else:
                        leaves[term] = fileformat._leaf(value * LATENCY_SCALE, "us", K_SOURCE)
                paths[path][way] = leaves
        params = {"paths": paths,
                  "call_us": {p: fileformat._leaf(v * LATENCY_SCALE, "us", K_SOURCE)
                              for p, v in base["call_us"].items()},
                  "sync_us": fileformat._leaf(base["sync_us"] * LATENCY_SCALE, "us", K_SOURCE)}
        plain = fileformat.plain_parameters({"parameters": params})
        out[name] = {
            "schema": fileformat.SCHEMA,
            "schema_version": fileformat.SCHEMA_VERSION,
            "status": "published",
            "note": (f"{fileformat.PUBLISHED_NOTE}. Built by sim/calibrate/published.py from the public figures "
                     "in reference/hardware-and-gguf.md and the H200 measurement (scenarios/hardware/calibration/"
                     "h200.json). Measure this card with `expertsim calibrate` (numba-cuda, CUDA >= 12.8 for "
                     "compute capability 12.0) and contribute the file (docs/calibration.md). "
                     + card["extra_note"]).strip(),
            "date": None,
            "command": None,
            "expertsim": None,
            "gpu": card["gpu"],
            "software": {},
            "grid": None,
            "kernel": {"derived_from": "h200.json", "latency_scale": round(LATENCY_SCALE, 4)},
            "parameters": params,
            "fit_error": None,
            "references": {},
            "simulator_profile": fileformat.simulator_profile(plain),
            "samples": {"columns": list(fileformat.fit.SAMPLE_COLUMNS), "rows": []},
        }
    return out


def write_all(directory: Path = CAL_DIR) -> list[Path]:
    h200 = fileformat.load(directory / "h200.json")
    return [fileformat.write(record, directory / f"{name}.json") for name, record in build(h200).items()]


if __name__ == "__main__":
    for written in write_all():
        print(written)
