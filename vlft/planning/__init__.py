"""Planning, before any weight is loaded: every policy resolved into a ``RunPlan``, the data checked,
targets chosen on a weightless model, the memory and sharding plans.
"""
