"""An example vlft plugin package: one backend module and one method module.

Each module is registered on its own through the ``vlft`` entry-point group
(see pyproject.toml), so a user can block one without the other.
"""
