"""Errors that cross layers."""


class JobError(Exception):
    """A problem with the whole job (missing input, unreadable model, unwritable output): one line, non-zero exit."""
