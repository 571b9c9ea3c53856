"""The engines' memory planning as pure functions (no SimPy, no I/O): see docs/planning.md.

ds4_plan     ds4's CUDA streaming expert cache (antirez/ds4 @80ebbc3 and PR #504)
strata_plan  Strata v0.1.35 and the #658 fork: sized-slot cache, slot lending, RAM tiers, conversation cache
"""
