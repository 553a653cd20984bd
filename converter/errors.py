"""Errors the user can act on. The CLI prints their message on one line and exits with `exit_code`.

Callers of the Python API can catch the narrow classes and read what went wrong from their attributes instead of
parsing messages (like huggingface_hub's errors); every class is a `ConverterError`, so catching that still catches
everything.
"""

from __future__ import annotations


class ConverterError(Exception):
    """Bad input or usage: the message names the file/tensor and says what to do."""

    exit_code = 2


class UsageError(ConverterError):
    """Options that cannot go together, or a required one missing."""


class BadInputError(ConverterError):
    """An input file is unusable. `file` is its path, `tensor` the tensor concerned (None when not one tensor)."""

    def __init__(self, message: str, *, file: object = None, tensor: str | None = None):
        super().__init__(message)
        self.file = None if file is None else str(file)
        self.tensor = tensor


class AdapterFormatError(BadInputError):
    """An adapter file or folder that cannot be read as any adapter format, or is inconsistent in itself."""


class RecipeError(BadInputError):
    """A recipe that is not valid YAML, has unknown keys or values of the wrong type."""


class HubError(ConverterError):
    """A Hub source or target that cannot be used: `repo_id` (and `revision` when one was asked for)."""

    def __init__(self, message: str, *, repo_id: str | None = None, revision: str | None = None):
        super().__init__(message)
        self.repo_id = repo_id
        self.revision = revision


class VerificationFailed(ConverterError):
    """The merged model is not base + adapters: `report` is the VerificationReport that says where (None for a
    check that has no report, such as a converted adapter read back)."""

    exit_code = 3

    def __init__(self, message: str, *, report: object = None):
        super().__init__(message)
        self.report = report


class NotVerified(ConverterError):
    """No proof could judge the merge (`report.notes` say why): the output is kept, marked not verified, and not
    pushed; `--no-verify` says the user takes it unproven."""

    exit_code = 5

    def __init__(self, message: str, *, report: object = None):
        super().__init__(message)
        self.report = report


class MissingExtraError(UsageError):
    """An optional dependency is not installed: `package`, which `pip install 'converter[extra]'` brings."""

    def __init__(self, message: str, *, package: str, extra: str):
        super().__init__(message)
        self.package = package
        self.extra = extra
