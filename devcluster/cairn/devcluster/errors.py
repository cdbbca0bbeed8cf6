"""The one exception type the devcluster raises for problems a user can fix.

Every failure a person can act on (a missing toolchain, a port in use, a stale
state directory, a failed build) becomes a `DevclusterError` whose message is
one line saying what happened and what to do; the CLI prints it without a
traceback.
"""


class DevclusterError(RuntimeError):
    """A problem with the local environment, described in one actionable line."""
