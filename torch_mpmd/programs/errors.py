"""The error a stage that cannot become programs raises (the runner keeps
that rank on the autograd path)."""

__all__ = ["ProgramsUnsupported"]


class ProgramsUnsupported(RuntimeError):
    """A stage cannot be turned into functional programs (the reason says why);
    the runner keeps that rank on the autograd path."""
