"""Built-in objective plugins (``--objective``), one module per objective, each registered as a plugin of its
own name (``PLUGIN_MODULES``, read by vlft/plugins.py; installed as ``vlft_objectives``).

Importing them imports neither torch nor transformers: the core's helpers they build on are imported inside
the hooks, at plan time.
"""

PLUGIN_MODULES = ("sft", "dpo", "orpo", "simpo", "kto", "grpo", "rewards")
