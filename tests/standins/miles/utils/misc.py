import importlib


def load_function(path):
    if path is None:
        return None
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)
