"""Errors the user can act on. The CLI prints their message on one line and exits with `exit_code`."""


class ConverterError(Exception):
    """Bad input or usage: the message names the file/tensor and says what to do."""

    exit_code = 2


class VerificationFailed(ConverterError):
    """The merged model does not behave like base + adapters."""

    exit_code = 3
