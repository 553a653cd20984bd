"""converter: fold LoRA adapters into base models exactly, stream the result, and prove it.

The recipe types and the errors are re-exported here; the verbs live in their modules (`converter.engine.merging.merge`,
`converter.jobs.pipeline.push` / `verify_folder`, `converter.convert.convert` ...; docs/python-api.md). `merge` is not
re-exported: the submodule `converter.engine.merging` has that name, and importing it would replace the function here.
Heavy libraries (torch, transformers, peft) are never imported by `import converter`.
"""

from converter.errors import ConverterError, NotVerified, VerificationFailed

__version__ = "0.1.0"

__all__ = ["AdapterSpec", "ConverterError", "NotVerified", "Recipe", "VerificationFailed", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import converter` stays cheap.
    if name in ("Recipe", "AdapterSpec"):
        from converter.engine import recipe

        return getattr(recipe, name)
    raise AttributeError(f"module 'converter' has no attribute {name!r}")
