"""The contracts between vlft and its plugins, one module per plugin kind: what a backend (``backend``), an
adapter method (``method``), a model family (``family``), a scorer (``scorer``) and a metric sink (``sinks``)
answer. Plugins import these from ``vlft``; the modules are where the core reads them from.
"""
