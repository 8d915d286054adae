"""An example vlft plugin package: a backend module, a method module and a model-family module (Gemma 3).

Each module is registered on its own through the ``vlft`` entry-point group
(see pyproject.toml), so a user can block one without the other.
"""
