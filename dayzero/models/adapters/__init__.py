"""Hugging Face architectures: one short module per family; importing this package registers them all."""
import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "common":
        importlib.import_module(f"{__name__}.{_m.name}")
