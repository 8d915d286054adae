"""Backends that ship with the core (the CPU reference); vendor backends live in plugins/."""
