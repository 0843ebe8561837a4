"""The one error type for bad configuration and bad input.

``ConfigError`` is raised by every check that runs before (or instead of) work: flags,
layouts, tokenizer and data files, checkpoint/run mismatches. The entry point prints it as
one line per problem (``error: ...``) once, from rank 0, and exits with status 2 on every
rank after the lines are out (:func:`tst_megatron.runtime.report_error`); so these checks
should give the same verdict on every rank (a problem found on some ranks only is printed
by each of them, tagged with the rank, after a wait). Any other exception is a crash: it
propagates with its traceback on the rank where it happened.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration or input problem the user fixes by changing a flag or a file.

    The message is one line that names the flag (or file) and the fix. Subclasses
    ``ValueError`` so callers that caught ``ValueError`` keep working.
    """
