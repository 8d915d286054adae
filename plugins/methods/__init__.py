"""Built-in adapter method plugins, one module per method, each on PEFT.

``PLUGIN_MODULES``: each is registered as a plugin of its own name (``vlft/plugins.py``); ``_peft`` is what
they share, not a plugin.
"""

PLUGIN_MODULES = ("lora", "oft")
