"""Errors that carry a stable code, so the command line and the service can report them the same way."""


class CaspError(Exception):
    """Base class: `code` is machine-readable, the message is for people."""

    code = "casp_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidConfig(CaspError):
    code = "invalid_config"


class ModelNotFound(CaspError):
    code = "model_not_found"


class UnsupportedModel(CaspError):
    code = "unsupported_model"


class InvalidModelFile(CaspError):
    """A model file that is not what its name says: a `.gguf` that is not GGUF, or one cut short."""

    code = "invalid_model_file"


class DatasetNotFound(CaspError):
    code = "dataset_not_found"


class InvalidDataset(CaspError):
    """Training data that cannot be used as it is (missing fields, empty, not UTF-8, too long); the message
    names the file and the line or record."""

    code = "invalid_dataset"


class DeviceUnavailable(CaspError):
    """A device this machine lacks (`cuda` without a usable GPU, `cuda:3` on a one-GPU machine)."""

    code = "device_unavailable"


class VerificationFailed(CaspError):
    """The physically pruned model does not reproduce the masked original."""

    code = "verification_failed"


class Cancelled(CaspError):
    code = "cancelled"


class NumericalError(CaspError):
    """NaN or infinity in the statistics, Q, S_l or the calibration loss: nothing after it can be trusted."""

    code = "numerical_error"


class DeviceMemoryTooSmall(CaspError):
    """Even one decoder layer's working set (casp_core.method.placement's estimate) exceeds the memory the job may use
    on the device, or a resident model was asked for that does not fit, or recovery's estimate does not fit:
    refused before any work."""

    code = "device_memory_too_small"


class CheckpointNotWritable(CaspError):
    """`casp upgrade` could not write into the checkpoint (read-only folder or file, full disk)."""

    code = "checkpoint_not_writable"


class BudgetUnmet(CaspError):
    """No candidate of a sweep met its target once written and measured (the size estimates that chose the
    candidates are close, not exact); the message names the closest one produced."""

    code = "budget_unmet"


class UnsupportedExport(CaspError):
    """An export the model's family or settings cannot take (a GGUF of a family llama.cpp cannot build layer by
    layer, or of settings the writer cannot write): refused before any work, the message naming the family."""

    code = "unsupported_export"


class DiskSpaceTooSmall(CaspError):
    """A file the job must write (the distillation teacher's cache) is larger than the free space where it goes:
    refused before the work that would fill it."""

    code = "disk_space_too_small"
