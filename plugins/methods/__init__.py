"""Built-in adapter method plugins, one module per method, each on PEFT."""
