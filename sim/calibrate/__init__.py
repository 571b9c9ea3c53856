"""GPU calibration: measure the expert-copy paths on a real GPU and fit the simulator's copy cost model.

- `kernel`: the gather-copy kernel (Numba CUDA) that replays a list of (source, destination, bytes)
  descriptors in one launch per path;
- `backend`: the memory arenas and a step's copies, as gather launches or the engines' own way (one
  cudaMemcpyAsync per expert part, a stream sync after each) for comparison;
- `selftest`: the kernel's self-test on random plans (outputs poisoned, every byte compared);
- `sweep`: `expertsim calibrate`, expert sizes x experts per step x path x way of copying, on the current GPU;
- `fit`: the cost model (fixed latency + bytes / bandwidth, per-copy, per-launch and per-descriptor terms),
  fitted to relative error, and its predictions;
- `replay`: `expertsim calibrate --replay RESULTS`, a simulated run's copy plan replayed on the GPU,
  predicted vs measured time per step;
- `fileformat`: the calibration file (JSON, schema version, provenance, raw samples, fitted parameters);
- `ggml_kernels`: not the GPU's: ggml's CPU kernels per core and GGML type, timed with a llama.cpp build's own
  llama-bench (the llama.cpp engine's CPU expert matmuls, records llamacpp-ggml-*);
- `llamacpp_layers`: a llama.cpp decode layer's fixed costs on a CUDA box (its GPU graph nodes' floor with and
  without CUDA graphs, a CPU MoE layer's split), timed with a CUDA build's llama-bench (records llamacpp-gpu-node-*,
  llamacpp-cpu-moe-split).

numba-cuda is imported in one place only (`cudaenv`), lazily, so the rest of expertsim never needs it; with
NUMBA_ENABLE_CUDASIM=1 the kernels run in Numba's CUDA simulator (no GPU, no CUDA toolkit needed).
"""
