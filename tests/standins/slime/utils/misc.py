import importlib


def load_function(path):
    """Load a function from a module (dotted path), as slime does."""
    module_path, _, attr = path.rpartition(".")
    module = importlib.import_module(module_path)
    return getattr(module, attr)
