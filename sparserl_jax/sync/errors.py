"""Errors raised by PULSESync. Every refusal leaves the receiver's weights untouched."""


class SyncError(RuntimeError):
    """Base class of all PULSESync refusals."""


class CorruptPatchError(SyncError):
    """Checksum, digest, structure or index validation failed."""


class TruncatedPatchError(CorruptPatchError):
    """The byte string ends before the header says it should."""


class VersionError(SyncError):
    """The patch does not continue the receiver's version chain."""


class OutOfOrderPatchError(VersionError):
    """`base_version` is not the receiver's current version (a version was skipped)."""


class DuplicatePatchError(VersionError):
    """The patch's new version is not newer than the receiver's: already applied."""


class BaseMismatchError(VersionError):
    """The patch was made for another base state than the receiver's (its `base_digest`)."""


class RunMismatchError(SyncError):
    """The blob was published by another run than the one the receiver (or publisher) follows."""


class MissingVersionError(SyncError):
    """A version needed to catch up is not available from the transport."""
