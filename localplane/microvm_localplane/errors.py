"""Errors of the guest runtime (re-exported by guests.py, where the interface names them)."""


class GuestError(Exception):
    pass


class DialError(GuestError):
    """The guest could not connect to that port (the message says why)."""
