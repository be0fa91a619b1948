"""Stand-in for miles.utils.processing_utils: the loaders GenerateState calls. The real
``load_tokenizer`` is ``AutoTokenizer.from_pretrained``; the stand-in resolves ``module:attribute``."""

import importlib


def load_tokenizer(name_or_path: str, chat_template_path: str | None = None, **kwargs):
    module, _, attr = name_or_path.partition(":")
    obj = getattr(importlib.import_module(module), attr)
    return obj() if isinstance(obj, type) else obj


def load_processor(name_or_path: str, **kwargs):
    return None
