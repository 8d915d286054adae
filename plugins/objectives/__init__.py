"""Built-in objective plugins (``--objective``), one module per objective, each registered through its own
entry point in group "vlft" (package-dir ``vlft_objectives = "plugins/objectives"``), as a third party would.

Importing them imports neither torch nor transformers: the core's helpers they build on are imported inside
the hooks, at plan time.
"""
