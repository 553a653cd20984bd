"""converter: fold LoRA adapters into base models exactly, stream the result, and prove it.

The public Python API is re-exported here; heavy libraries (transformers, peft) are never imported by it.
"""

from converter.errors import ConverterError, VerificationFailed

__version__ = "0.1.0"

__all__ = ["ConverterError", "VerificationFailed", "__version__", "merge", "Recipe", "AdapterSpec"]


def __getattr__(name: str):
    # Lazy so that `import converter` stays cheap (torch is imported only when a merge runs).
    if name == "merge":
        from converter.merge import merge

        return merge
    if name in ("Recipe", "AdapterSpec"):
        from converter import recipe

        return getattr(recipe, name)
    raise AttributeError(name)
