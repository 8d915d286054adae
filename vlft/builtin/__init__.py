"""The built-in plugins that name no vendor: the CPU reference backend, the TensorBoard metric sink and
the commands plugin. They register through the ``vlft`` entry-point group like any third-party plugin.
"""
