"""Stand-in for slime.utils.processing_utils: the two loaders GenerateState calls.

The real ``load_tokenizer`` is ``AutoTokenizer.from_pretrained(name_or_path)``; tests have no
Hugging Face models, so the stand-in resolves ``module:attribute`` (a class or an instance) instead.
"""

import importlib


def load_tokenizer(name_or_path: str, **kwargs):
    module, _, attr = name_or_path.partition(":")
    obj = getattr(importlib.import_module(module), attr)
    return obj() if isinstance(obj, type) else obj


def load_processor(name_or_path: str, **kwargs):
    return None  # text-only models: the real loader also answers None when there is no processor
