# The package's pytest plugin (installed, pytest finds it by its entry point; from a checkout it
# is on PYTHONPATH only), and pytester, which tests the plugin in a pytest of its own.
pytest_plugins = ["moe_audit.pytest_plugin", "pytester"]
