"""Error types. Each message names the file, tensor, field, env value or backend at fault.

The CLI prints ``error: <message>`` for any :class:`DinferError` and exits non-zero
without a traceback (``--debug`` shows it).
"""


class DinferError(Exception):
    """Base class for every error dinfer-rt raises on bad input or environment."""


class ConfigError(DinferError):
    """config.json / tokenizer_config.json is missing a field or holds an unsupported value."""


class CheckpointError(DinferError):
    """A safetensors file, index or tensor is missing, corrupt, unexpected or mis-shaped."""


class TokenizerError(DinferError):
    """tokenizer.json is missing, or disagrees with the model (vocab size, special ids)."""


class BackendError(DinferError):
    """A backend is unknown, unavailable, or failed to load."""


class GenerationError(DinferError):
    """Generation parameters or prompts are invalid."""
