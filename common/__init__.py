"""Shared pieces of rollstream: data model, codec, Redis keys, config, Lua scripts, errors."""
