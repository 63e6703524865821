"""patchctl: versioned SGLang patches, rolled out over SSH with smoke checks and verified rollback."""

__version__ = "0.1.0"
