"""Errors that cross layers."""


class JobError(Exception):
    """A problem with the whole job (missing input, unreadable model, unwritable output): one line, non-zero exit."""

    exit_code = 1


class JobUsageError(JobError):
    """The job as asked cannot start: its settings do not fit its input (a Parquet input without the prompt column
    the job reads). One line, exit 2, as for a bad flag."""

    exit_code = 2
