"""npllm's own exceptions: every bad input ends in one of these, with a message that names the file and the problem."""


class NpllmError(Exception):
    """Base class of every error npllm raises on purpose."""


class FormatError(NpllmError, ValueError):
    """A checkpoint or tokenizer file is missing, truncated, or not what its header says."""


class ConfigError(NpllmError, ValueError):
    """Model metadata is absent, contradictory, or describes something npllm cannot run."""


class TokenizerError(NpllmError, ValueError):
    """A tokenizer cannot be loaded, or does not fit the model."""


class GenerationError(NpllmError, ValueError):
    """A generation request cannot be served (prompt longer than the context, bad sampling parameter, ...)."""


class ConstraintError(GenerationError):
    """A structured-output constraint (JSON Schema, regex, grammar) that is malformed or would not be enforced."""


class DownloadError(NpllmError, OSError):
    """A download failed, was truncated, or did not match its checksum; nothing was left behind."""


class DeviceError(NpllmError, RuntimeError):
    """The requested device cannot be used here (no GPU, no driver, numba's CUDA target not installed)."""


class ChatTemplateError(NpllmError, ValueError):
    """A chat template cannot be found, does not compile, or raised an error while rendering (its message kept)."""


class SettingError(NpllmError, ValueError):
    """An NPLLM_* environment variable (or the setting it stands for) holds a value outside its range."""
