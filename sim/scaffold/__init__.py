"""Starting files: a commented scenario for a model on a machine (sim.scaffold.scenario), and a what-if copy of a
hardware profile (sim.scaffold.hardware).

    expertsim scenario init --model deepseek-v4-flash-q2-q4 --hardware rtx-4090 -o mine.toml
    expertsim hardware init rtx-pro-6000-96gb --set gpu.vram_gib=48 -o hardware/what-if-48gb.toml

Both are TOML text written here (sim.scaffold.toml_text), and neither is written unless it loads
(sim.scaffold.writing).
"""

from sim.scaffold.hardware import write_hardware
from sim.scaffold.scenario import write_scenario

__all__ = ["write_hardware", "write_scenario"]
